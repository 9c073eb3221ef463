/* clock: the project's one monotonic clock.
 *
 * Every duration the project reports (timings of samples, weight pushes,
 * calibration, scheduler steps) is a difference of two readings of this
 * clock; a wall clock could step backwards under NTP and make them negative. */
#ifndef FR_CLOCK_H
#define FR_CLOCK_H

#ifdef __cplusplus
extern "C" {
#endif

/* Seconds since an arbitrary fixed point (CLOCK_MONOTONIC). */
double fr_now_s(void);

/* The same reading in milliseconds, for the protocol's millisecond fields. */
double fr_now_ms(void);

#ifdef __cplusplus
}
#endif

#endif
