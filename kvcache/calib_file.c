#include "kvcache/calib_file.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/atomic_file.h"
#include "attention/prob_quant.h"
#include "base/safetensors.h"

static fr_status load_tensor(const fr_st_file *f, const char *path, const char *name, int ndim,
                             const int64_t *shape, float **out)
{
    const fr_st_tensor *t = fr_st_file_find(f, name);
    *out = NULL;
    if (!t) return FR_OK;
    fr_status st = fr_st_check_shape(t, path, ndim, shape);
    if (st) return st;
    size_t n = fr_st_tensor_numel(t);
    *out = malloc(sizeof(float) * (n ? n : 1));
    if (!*out) return fr_fail(FR_ENOMEM, "%s: out of memory", path);
    st = fr_st_tensor_to_f32(t, *out, n);
    if (st) { free(*out); *out = NULL; }
    return st;
}

/* Finite key means; FP8 scales finite and positive. */
static fr_status check_values(const char *path, fr_calib_dims dims, const fr_calib *c, fr_status code)
{
    size_t nk = (size_t)dims.layers * dims.kv_heads * dims.head_dim;
    size_t nf = (size_t)dims.layers * dims.kv_heads * 2;
    for (size_t i = 0; i < nk; i++)
        if (!isfinite(c->key_mean[i]))
            return fr_fail(code, "%s: key_mean element %zu is not finite", path, i);
    for (size_t i = 0; c->fp8_scales && i < nf; i++)
        if (!isfinite(c->fp8_scales[i]) || !(c->fp8_scales[i] > 0.0f))
            return fr_fail(code, "%s: fp8_scales element %zu (%g) is not a positive finite number", path, i,
                           c->fp8_scales[i]);
    return FR_OK;
}

fr_status fr_calib_load(const char *path, fr_calib_dims dims, fr_calib *out)
{
    memset(out, 0, sizeof *out);
    out->tau = FR_P_TAU;
    fr_st_file *f;
    fr_status st = fr_st_file_open(path, &f);
    if (st) return st;
    int64_t km[3] = {dims.layers, dims.kv_heads, dims.head_dim};
    int64_t fs[3] = {dims.layers, dims.kv_heads, 2};
    int64_t one[1] = {1};
    float *tau = NULL;
    st = load_tensor(f, path, "key_mean", 3, km, &out->key_mean);
    if (!st && !out->key_mean) st = fr_fail(FR_EFORMAT, "%s: missing tensor key_mean", path);
    if (!st) st = load_tensor(f, path, "tau", 1, one, &tau);
    if (!st) st = load_tensor(f, path, "fp8_scales", 3, fs, &out->fp8_scales);
    if (!st && tau) {
        if (!(tau[0] > 0.0f && tau[0] < 6.0f)) st = fr_fail(FR_EFORMAT, "%s: tau %g out of range", path, tau[0]);
        out->tau = tau[0];
        out->has_tau = 1;
    }
    if (!st) st = check_values(path, dims, out, FR_EFORMAT);
    free(tau);
    fr_st_file_close(&f);
    if (st) fr_calib_free(out);
    return st;
}

void fr_calib_free(fr_calib *c)
{
    free(c->key_mean);
    free(c->fp8_scales);
    c->key_mean = c->fp8_scales = NULL;
}

/* Writes a safetensors file: header JSON padded to 8 bytes, then the data. */
fr_status fr_calib_save(const char *path, fr_calib_dims dims, const fr_calib *c)
{
    size_t nk = (size_t)dims.layers * dims.kv_heads * dims.head_dim;
    size_t nf = c->fp8_scales ? (size_t)dims.layers * dims.kv_heads * 2 : 0;
    if (!c->key_mean) return fr_fail(FR_EINVAL, "%s: no key mean to write", path);
    if (!(c->tau > 0.0f && c->tau < 6.0f)) return fr_fail(FR_EINVAL, "%s: tau %g out of range", path, c->tau);
    fr_status vst = check_values(path, dims, c, FR_EINVAL);
    if (vst) return vst;
    char header[1024];
    int len = snprintf(header, sizeof header,
                       "{\"key_mean\":{\"dtype\":\"F32\",\"shape\":[%d,%d,%d],\"data_offsets\":[0,%zu]},"
                       "\"tau\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[%zu,%zu]}",
                       dims.layers, dims.kv_heads, dims.head_dim, nk * 4, nk * 4, nk * 4 + 4);
    if (nf)
        len += snprintf(header + len, sizeof header - (size_t)len,
                        ",\"fp8_scales\":{\"dtype\":\"F32\",\"shape\":[%d,%d,2],\"data_offsets\":[%zu,%zu]}",
                        dims.layers, dims.kv_heads, nk * 4 + 4, nk * 4 + 4 + nf * 4);
    len += snprintf(header + len, sizeof header - (size_t)len, "}");
    while (len % 8) header[len++] = ' ';
    fr_atomic_file out;
    fr_status st = fr_atomic_file_open(&out, path);
    if (st) return st;
    uint64_t hl = (uint64_t)len;
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(hl >> (8 * i));
    FILE *fp = out.f;
    int ok = fwrite(le, 1, 8, fp) == 8 && fwrite(header, 1, (size_t)len, fp) == (size_t)len &&
             fwrite(c->key_mean, 4, nk, fp) == nk && fwrite(&c->tau, 4, 1, fp) == 1 &&
             (!nf || fwrite(c->fp8_scales, 4, nf, fp) == nf);
    st = fr_atomic_file_close(&out, ok);
    if (!ok && !st) st = fr_fail(FR_EIO, "cannot write %s", path);
    return st;
}
