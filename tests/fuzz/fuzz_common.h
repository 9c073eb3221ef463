/* Shared by the fuzz targets: a check that stops the fuzzer with a message
 * when a parser breaks one of its documented promises (libFuzzer reports the
 * abort as a crash and saves the input). */
#ifndef FR_FUZZ_COMMON_H
#define FR_FUZZ_COMMON_H

#include <stdio.h>
#include <stdlib.h>

#define FUZZ_CHECK(cond, ...)                                              \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
            abort();                                                       \
        }                                                                  \
    } while (0)

#endif
