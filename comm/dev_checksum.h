/* dev_checksum: the checksum of a weight bucket that travels over NCCL,
 * computed where the bytes are (GPU memory) by the sender and by every
 * receiver with the same kernel, so neither side copies a bucket to the host.
 *
 * Definition (the wire's `checksum`, docs/protocol.md): cut the bytes into
 * chunks of FR_DEV_CHECKSUM_CHUNK bytes (the last one shorter); each chunk's
 * digest is its xxHash64 with seed 0; the checksum is the xxHash64, seed 0,
 * of the digests as consecutive little-endian uint64. One GPU thread hashes
 * one chunk, so a 512 MiB bucket keeps 32768 threads busy; the host combines
 * the short digest array.
 *
 * fr_dev_checksum_host computes the same value from host memory (tests, and
 * a reference for other implementations); it and fr_dev_checksum_combine
 * build without CUDA. The kernel launch is in dev_checksum_cuda.cu (nvcc only). */
#ifndef FR_DEV_CHECKSUM_H
#define FR_DEV_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

#include "comm_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_DEV_CHECKSUM_CHUNK ((size_t)16384)

/* Digests of a buffer of `bytes` bytes: ceil(bytes / FR_DEV_CHECKSUM_CHUNK). */
size_t fr_dev_checksum_chunks(size_t bytes);

/* The checksum from the chunk digests (host memory). */
uint64_t fr_dev_checksum_combine(const uint64_t *digests, size_t n);

/* The checksum of host memory, chunk by chunk (the definition above), into
 * *out; FR_COMM_ENOMEM when the digest array cannot be allocated. */
fr_comm_status fr_dev_checksum_host(const void *data, size_t bytes, uint64_t *out);

/* Enqueues on `stream` (a cudaStream_t; void * so this header needs no CUDA)
 * the chunk digests of device bytes [data, data + bytes) into the device
 * array digests (fr_dev_checksum_chunks(bytes) entries). FR_COMM_ECUDA with
 * CUDA's text when the launch fails; FR_COMM_EUNSUPPORTED in a build
 * without CUDA. */
fr_comm_status fr_dev_checksum_launch(const void *data, size_t bytes, uint64_t *digests, void *stream);

#ifdef __cplusplus
}
#endif

#endif
