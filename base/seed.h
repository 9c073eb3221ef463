/* Sampling seeds: a fresh one from the operating system, and a stream of
 * them (docs/sampling.md, "Seeds").
 *
 *     fr_seed_stream st;
 *     fr_seed_stream_init(&st, 0, 0);       // from the operating system
 *     uint64_t s = fr_seed_stream_next(&st);
 *
 * A stream started from a given seed yields the same seeds in the same
 * order, so a server configured with a seed replays its unseeded requests. */
#ifndef FR_SEED_H
#define FR_SEED_H

#include <stdint.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    uint64_t state;
} fr_seed_stream;

/* 64 bits from the operating system's random source (getrandom); FR_EIO
 * with a message when it has none to give. */
fr_status fr_seed_from_os(uint64_t *out);

/* Starts st from `seed` when `given`, else from the operating system
 * (FR_EIO when that fails; st is then left unusable). */
fr_status fr_seed_stream_init(fr_seed_stream *st, int given, uint64_t seed);

/* The next seed of the stream. Consecutive outputs are well mixed even
 * when the starting seed is a small integer such as 0 or 1. */
uint64_t fr_seed_stream_next(fr_seed_stream *st);

#ifdef __cplusplus
}
#endif

#endif
