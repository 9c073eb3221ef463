/* safetensors: a reader for Hugging Face's tensor file format.
 *
 * A file is an 8-byte little-endian header length N, N bytes of JSON mapping
 * tensor names to {dtype, shape, data_offsets}, then the data region. Offsets
 * are relative to the data region's start.
 *
 * Two layers: st_parse_header() validates a whole file image that is already
 * in memory and holds no global state, so a fuzzer can drive it directly;
 * st_file_open() mmaps a file and hands the mapping to the same parser.
 *
 * Tensor data points into the caller's buffer (or the mapping) and is NOT
 * aligned: the data region starts at 8 + N, wherever that is. Read it through
 * st_tensor_to_f32() or memcpy, never by casting to float *.
 */
#ifndef FR_SAFETENSORS_H
#define FR_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "attention/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ST_MAX_DIMS 8

typedef enum {
    ST_F32, ST_F16, ST_BF16, ST_F64, ST_I64, ST_I32, ST_I16, ST_I8, ST_U8, ST_BOOL
} st_dtype;

size_t st_dtype_size(st_dtype dt);        /* bytes per element; 0 for an invalid value */
const char *st_dtype_name(st_dtype dt);   /* "F32", ...; "?" for an invalid value */

typedef struct {
    const char *name;
    st_dtype dtype;
    int ndim;                     /* 0 for a scalar */
    int64_t shape[ST_MAX_DIMS];
    size_t nbytes;                /* == st_tensor_numel() * st_dtype_size(dtype) */
    const void *data;             /* unaligned; see above */
} st_tensor;

size_t st_tensor_numel(const st_tensor *t);

/* Writes "[2, 3]" into buf (truncated to size), for error messages. */
void st_shape_str(char *buf, size_t size, int ndim, const int64_t *shape);
/* FR_OK when t has exactly this shape, else FR_EFORMAT with
 * "FILE: tensor NAME has shape [..], expected [..]". */
fr_status st_check_shape(const st_tensor *t, const char *file, int ndim, const int64_t *shape);

/* ---- parsed header over a caller-owned image --------------------------- */

typedef struct st_header st_header;

/* Parses and validates a whole file image buf[0, len). `label` (usually the
 * path) starts every error message. On success *out borrows buf: keep buf
 * alive and unchanged until st_header_free(). Tensors are ordered by name. */
fr_status st_parse_header(const uint8_t *buf, size_t len, const char *label, st_header **out);
int st_header_count(const st_header *h);
const st_tensor *st_header_tensor(const st_header *h, int i);          /* NULL when out of range */
const st_tensor *st_header_find(const st_header *h, const char *name); /* NULL when absent */
void st_header_free(st_header **h);                                    /* sets *h = NULL; accepts NULL */

/* ---- a memory-mapped file ------------------------------------------------ */

typedef struct st_file st_file;

fr_status st_file_open(const char *path, st_file **out);
const char *st_file_path(const st_file *f);
int st_file_count(const st_file *f);
const st_tensor *st_file_tensor(const st_file *f, int i);          /* name order; NULL when out of range */
const st_tensor *st_file_find(const st_file *f, const char *name); /* NULL when absent */
void st_file_close(st_file **f);                                   /* sets *f = NULL; accepts NULL */

/* Converts an F32, F16 or BF16 tensor into float32 exactly (F16 subnormals,
 * infinities and NaNs included). n_elems must equal the tensor's element
 * count; other dtypes give FR_EUNSUPPORTED. */
fr_status st_tensor_to_f32(const st_tensor *t, float *dst, size_t n_elems);

#ifdef __cplusplus
}
#endif

#endif
