/* The host half of comm/dev_checksum.h: the combination of chunk digests and
 * the reference checksum of host memory. */
#include "dev_checksum.h"

#include <stdlib.h>
#include <xxhash.h>

/* The digests are hashed as their little-endian bytes; on a little-endian
 * host (every platform the project builds for) that is their memory. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "dev_checksum assumes a little-endian host");

size_t fr_dev_checksum_chunks(size_t bytes) { return (bytes + FR_DEV_CHECKSUM_CHUNK - 1) / FR_DEV_CHECKSUM_CHUNK; }

uint64_t fr_dev_checksum_combine(const uint64_t *digests, size_t n)
{
    return XXH64(n ? (const void *)digests : "", n * sizeof(uint64_t), 0);
}

fr_comm_status fr_dev_checksum_host(const void *data, size_t bytes, uint64_t *out)
{
    if (!out || (bytes && !data)) return fr_comm_fail(FR_COMM_EINVAL, "fr_dev_checksum_host: NULL argument");
    const size_t n = fr_dev_checksum_chunks(bytes);
    uint64_t *d = malloc((n ? n : 1) * sizeof *d);
    if (!d) return fr_comm_fail(FR_COMM_ENOMEM, "fr_dev_checksum_host: out of memory");
    for (size_t i = 0; i < n; i++) {
        const size_t at = i * FR_DEV_CHECKSUM_CHUNK;
        const size_t len = bytes - at < FR_DEV_CHECKSUM_CHUNK ? bytes - at : FR_DEV_CHECKSUM_CHUNK;
        d[i] = XXH64((const unsigned char *)data + at, len, 0);
    }
    *out = fr_dev_checksum_combine(d, n);
    free(d);
    return FR_COMM_OK;
}
