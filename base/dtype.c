#include "base/dtype.h"

#include <string.h>

static const struct {
    const char *name, *file_name;
    size_t size;
} info[FR_DTYPE_COUNT] = {
    [FR_DTYPE_F32] = {"f32", "F32", 4},   [FR_DTYPE_BF16] = {"bf16", "BF16", 2},
    [FR_DTYPE_F16] = {"f16", "F16", 2},   [FR_DTYPE_F64] = {"f64", "F64", 8},
    [FR_DTYPE_I64] = {"i64", "I64", 8},   [FR_DTYPE_I32] = {"i32", "I32", 4},
    [FR_DTYPE_I16] = {"i16", "I16", 2},   [FR_DTYPE_I8] = {"i8", "I8", 1},
    [FR_DTYPE_U8] = {"u8", "U8", 1},      [FR_DTYPE_BOOL] = {"bool", "BOOL", 1},
};

/* Through int: the enum may come from a file or a message as any integer. */
static int valid(fr_dtype t) { return (int)t >= 0 && (int)t < FR_DTYPE_COUNT; }

size_t fr_dtype_size(fr_dtype t) { return valid(t) ? info[t].size : 0; }
const char *fr_dtype_name(fr_dtype t) { return valid(t) ? info[t].name : "?"; }
const char *fr_dtype_file_name(fr_dtype t) { return valid(t) ? info[t].file_name : "?"; }

int fr_dtype_from_file_name(const char *s, size_t len, fr_dtype *out)
{
    for (int i = 0; i < FR_DTYPE_COUNT; i++)
        if (strlen(info[i].file_name) == len && memcmp(info[i].file_name, s, len) == 0) {
            *out = (fr_dtype)i;
            return 1;
        }
    return 0;
}

int fr_dtype_is_weight(fr_dtype t) { return t == FR_DTYPE_F32 || t == FR_DTYPE_BF16 || t == FR_DTYPE_F16; }
