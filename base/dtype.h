/* dtype: the one element-type enum of the project.
 *
 * Checkpoint tensors, weight-update pieces on the wire, staged weights and
 * NCCL transfers all name their element type with fr_dtype, so a type read
 * from a file or a message reaches the engine and the device code without a
 * translation table in between. The first three values are fixed: the C
 * client's ABI (and the Python client through it) passes them as integers. */
#ifndef FR_DTYPE_H
#define FR_DTYPE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FR_DTYPE_F32 = 0,
    FR_DTYPE_BF16 = 1,
    FR_DTYPE_F16 = 2,
    FR_DTYPE_F64,
    FR_DTYPE_I64,
    FR_DTYPE_I32,
    FR_DTYPE_I16,
    FR_DTYPE_I8,
    FR_DTYPE_U8,
    FR_DTYPE_BOOL,
    FR_DTYPE_COUNT
} fr_dtype;

/* Bytes per element; 0 for a value outside the enum. */
size_t fr_dtype_size(fr_dtype t);

/* The protocol's spelling ("f32", "bf16", ...); "?" outside the enum. */
const char *fr_dtype_name(fr_dtype t);

/* The safetensors spelling ("F32", "BF16", ...); "?" outside the enum. */
const char *fr_dtype_file_name(fr_dtype t);

/* The type whose safetensors spelling is s[0, len): 1 and *out set when
 * there is one, else 0 and *out untouched. */
int fr_dtype_from_file_name(const char *s, size_t len, fr_dtype *out);

/* Whether t is one of the floating types weights travel in (f32, bf16, f16). */
int fr_dtype_is_weight(fr_dtype t);

#ifdef __cplusplus
}
#endif

#endif
