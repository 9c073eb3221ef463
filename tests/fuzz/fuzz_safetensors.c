/* libFuzzer target: the safetensors header parser (base/safetensors.h)
 * on arbitrary file images.
 *
 * Every tensor of an accepted image is walked the way the loaders walk
 * them: looked up by name, its shape checked and formatted, and the float
 * dtypes converted to float32, so a bad offset or size shows up as an
 * out-of-bounds read under ASan. The header's own promises are checked too:
 * tensors sorted by unique name, nbytes == numel * dtype size, and data
 * inside the data region. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/safetensors.h"
#include "tests/fuzz/fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void walk(const fr_st_tensor *t, const uint8_t *region, const uint8_t *end, const fr_st_header *h)
{
    FUZZ_CHECK(t->name != NULL, "tensor without a name");
    FUZZ_CHECK(t->ndim >= 0 && t->ndim <= FR_ST_MAX_DIMS, "%s: ndim %d", t->name, t->ndim);
    size_t esize = fr_dtype_size(t->dtype);
    FUZZ_CHECK(esize > 0, "%s: dtype %d has no size", t->name, (int)t->dtype);
    FUZZ_CHECK(strcmp(fr_dtype_file_name(t->dtype), "?") != 0, "%s: dtype %d has no name", t->name, (int)t->dtype);
    size_t numel = fr_st_tensor_numel(t);
    FUZZ_CHECK(t->nbytes == numel * esize, "%s: nbytes %zu, numel %zu x %zu", t->name, t->nbytes, numel, esize);
    const uint8_t *p = t->data;
    FUZZ_CHECK(p >= region && p <= end && t->nbytes <= (size_t)(end - p), "%s: data outside the data region",
               t->name);
    FUZZ_CHECK(fr_st_header_find(h, t->name) == t, "%s: lookup by name finds another entry", t->name);
    FUZZ_CHECK(fr_st_check_shape(t, "fuzz", t->ndim, t->shape) == FR_OK, "%s: own shape refused", t->name);

    char dims[64];
    fr_st_shape_str(dims, sizeof dims, t->ndim, t->shape);
    FUZZ_CHECK(dims[0] == '[', "%s: shape string \"%s\"", t->name, dims);

    float *out = malloc((numel ? numel : 1) * sizeof *out);
    if (!out) return;
    fr_status st = fr_st_tensor_to_f32(t, out, numel);
    if (t->dtype == FR_DTYPE_F32 || t->dtype == FR_DTYPE_F16 || t->dtype == FR_DTYPE_BF16)
        FUZZ_CHECK(st == FR_OK, "%s: conversion of a %s tensor failed: %s", t->name, fr_dtype_file_name(t->dtype),
                   fr_last_error());
    else
        FUZZ_CHECK(st == FR_EUNSUPPORTED, "%s: %s converted to float32", t->name, fr_dtype_file_name(t->dtype));
    if (numel) FUZZ_CHECK(fr_st_tensor_to_f32(t, out, numel + 1) == FR_EINVAL, "%s: wrong count accepted", t->name);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fr_st_header *h = NULL;
    fr_status st = fr_st_parse_header(data, size, "fuzz.safetensors", &h);
    if (st != FR_OK) {
        FUZZ_CHECK(h == NULL, "a refused image left a header");
        FUZZ_CHECK(fr_last_error()[0] != '\0', "a refused image left no message");
        return 0;
    }
    FUZZ_CHECK(h != NULL && size >= 8, "accepted without a header");

    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)data[i] << (8 * i);
    FUZZ_CHECK(hlen <= size - 8, "accepted a header running past the image");
    const uint8_t *region = data + 8 + hlen, *end = data + size;

    int n = fr_st_header_count(h);
    FUZZ_CHECK(n >= 0, "count %d", n);
    for (int i = 0; i < n; i++) {
        const fr_st_tensor *t = fr_st_header_tensor(h, i);
        FUZZ_CHECK(t != NULL, "tensor %d of %d missing", i, n);
        if (i > 0)
            FUZZ_CHECK(strcmp(fr_st_header_tensor(h, i - 1)->name, t->name) < 0, "tensors %d and %d out of order",
                       i - 1, i);
        walk(t, region, end, h);
    }
    FUZZ_CHECK(fr_st_header_tensor(h, n) == NULL && fr_st_header_tensor(h, -1) == NULL, "index out of range answered");
    fr_st_header_free(&h);
    FUZZ_CHECK(h == NULL, "fr_st_header_free did not clear the pointer");
    return 0;
}
