/* Small helpers of the benches: CPU time, a qsort comparison for medians,
 * reading a whole text file (wall-clock time is base/clock.h's fr_now_s)
 * and a comma list of integers. Header-only, for the C and CUDA programs of
 * bench/ (one file each). */
#ifndef FR_BENCH_UTIL_H
#define FR_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* CPU seconds of this process: a shared machine's other load does not count. */
static inline double fr_bench_cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline int fr_bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The file's bytes, NUL-terminated (free()), and their count in *len; NULL
 * (and *len 0) when it cannot be read. */
static inline char *fr_bench_read_file(const char *path, size_t *len)
{
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = n >= 0 ? (char *)malloc((size_t)n + 1) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (!b) return NULL;
    b[n] = '\0';
    *len = (size_t)n;
    return b;
}

/* The integers of a comma list ("1,16,64") into out, at most max of them;
 * returns how many. */
static inline int fr_bench_int_list(const char *s, int *out, int max)
{
    int n = 0;
    for (const char *p = s; *p && n < max;) {
        out[n++] = atoi(p);
        const char *c = strchr(p, ',');
        if (!c) break;
        p = c + 1;
    }
    return n;
}

#endif
