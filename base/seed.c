#include "base/seed.h"

#include <errno.h>
#include <string.h>
#include <sys/random.h>

fr_status fr_seed_from_os(uint64_t *out)
{
    if (!out) return fr_fail(FR_EINVAL, "seed: no place for the seed");
    unsigned char b[sizeof *out];
    size_t got = 0;
    while (got < sizeof b) {
        ssize_t r = getrandom(b + got, sizeof b - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return fr_fail(FR_EIO, "seed: the operating system gave no random bytes (getrandom: %s)",
                                   r < 0 ? strerror(errno) : "no bytes");
        got += (size_t)r;
    }
    memcpy(out, b, sizeof b);
    return FR_OK;
}

fr_status fr_seed_stream_init(fr_seed_stream *st, int given, uint64_t seed)
{
    if (!st) return fr_fail(FR_EINVAL, "seed: no stream to start");
    st->state = 0;
    if (given) {
        st->state = seed;
        return FR_OK;
    }
    return fr_seed_from_os(&st->state);
}

/* SplitMix64 (Steele, Lea and Flood, OOPSLA 2014): a Weyl sequence through
 * a bijective mixer, so seeds never repeat within 2^64 draws and adjacent
 * requests get unrelated Philox keys. */
uint64_t fr_seed_stream_next(fr_seed_stream *st)
{
    if (!st) return 0;
    uint64_t z = (st->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
