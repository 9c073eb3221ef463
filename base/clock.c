#include "base/clock.h"

#include <time.h>

double fr_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Computed from the timespec rather than as 1e3 * fr_now_s() so that a
 * millisecond reading keeps its sub-microsecond digits on long uptimes. */
double fr_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}
