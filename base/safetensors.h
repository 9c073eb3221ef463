/* safetensors: a reader for Hugging Face's tensor file format.
 *
 * A file is an 8-byte little-endian header length N, N bytes of JSON mapping
 * tensor names to {dtype, shape, data_offsets}, then the data region. Offsets
 * are relative to the data region's start.
 *
 * Two layers: fr_st_parse_header() validates a whole file image that is already
 * in memory and holds no global state, so a fuzzer can drive it directly;
 * fr_st_file_open() mmaps a file and hands the mapping to the same parser.
 *
 * Tensor data points into the caller's buffer (or the mapping) and is NOT
 * aligned: the data region starts at 8 + N, wherever that is. Read it through
 * fr_st_tensor_to_f32() or memcpy, never by casting to float *.
 */
#ifndef FR_SAFETENSORS_H
#define FR_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_ST_MAX_DIMS 8

typedef struct {
    const char *name;
    fr_dtype dtype;
    int ndim;                     /* 0 for a scalar */
    int64_t shape[FR_ST_MAX_DIMS];
    size_t nbytes;                /* == fr_st_tensor_numel() * fr_dtype_size(dtype) */
    const void *data;             /* unaligned; see above */
} fr_st_tensor;

size_t fr_st_tensor_numel(const fr_st_tensor *t);

/* Writes "[2, 3]" into buf (truncated to size), for error messages. */
void fr_st_shape_str(char *buf, size_t size, int ndim, const int64_t *shape);
/* FR_OK when t has exactly this shape, else FR_EFORMAT with
 * "FILE: tensor NAME has shape [..], expected [..]". */
fr_status fr_st_check_shape(const fr_st_tensor *t, const char *file, int ndim, const int64_t *shape);

/* ---- parsed header over a caller-owned image --------------------------- */

typedef struct fr_st_header fr_st_header;

/* Parses and validates a whole file image buf[0, len). `label` (usually the
 * path) starts every error message. On success *out borrows buf: keep buf
 * alive and unchanged until fr_st_header_free(). Tensors are ordered by name. */
fr_status fr_st_parse_header(const uint8_t *buf, size_t len, const char *label, fr_st_header **out);
int fr_st_header_count(const fr_st_header *h);
const fr_st_tensor *fr_st_header_tensor(const fr_st_header *h, int i);          /* NULL when out of range */
const fr_st_tensor *fr_st_header_find(const fr_st_header *h, const char *name); /* NULL when absent */
void fr_st_header_free(fr_st_header **h);                                    /* sets *h = NULL; accepts NULL */

/* ---- a memory-mapped file ------------------------------------------------ */

typedef struct fr_st_file fr_st_file;

fr_status fr_st_file_open(const char *path, fr_st_file **out);
const char *fr_st_file_path(const fr_st_file *f);
int fr_st_file_count(const fr_st_file *f);
const fr_st_tensor *fr_st_file_tensor(const fr_st_file *f, int i);          /* name order; NULL when out of range */
const fr_st_tensor *fr_st_file_find(const fr_st_file *f, const char *name); /* NULL when absent */
void fr_st_file_close(fr_st_file **f);                                   /* sets *f = NULL; accepts NULL */

/* Converts an F32, F16 or BF16 tensor into float32 exactly (F16 subnormals,
 * infinities and NaNs included). n_elems must equal the tensor's element
 * count; other dtypes give FR_EUNSUPPORTED. */
fr_status fr_st_tensor_to_f32(const fr_st_tensor *t, float *dst, size_t n_elems);

#ifdef __cplusplus
}
#endif

#endif
