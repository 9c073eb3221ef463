#include "kv_numerics.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

fr_recipe fr_recipe_full(void)
{
    return (fr_recipe){.smooth = 1, .rotate = 1, .scale_search = 1, .dual_query = 1,
                       .p_scaling = 1, .sink_recent = 1};
}

fr_recipe fr_recipe_vanilla(void) { return (fr_recipe){0}; }

static const char *const dtype_names[] = {"bf16", "fp8", "nvfp4", "mxfp4", "f32"};

fr_status fr_kv_dtype_parse(const char *s, fr_kv_dtype *out)
{
    for (int i = 0; i < 5; i++)
        if (s && strcmp(s, dtype_names[i]) == 0) { *out = (fr_kv_dtype)i; return FR_OK; }
    return fr_fail(FR_EINVAL, "unknown kv dtype '%s' (expected bf16, fp8, nvfp4, mxfp4 or f32)",
                   s ? s : "(null)");
}

const char *fr_kv_dtype_name(fr_kv_dtype t) { return (unsigned)t < 5 ? dtype_names[t] : "?"; }

int fr_kv_dtype_is_fp4(fr_kv_dtype t) { return t == FR_KV_NVFP4 || t == FR_KV_MXFP4; }

fr_fp4_format fr_kv_dtype_fp4_format(fr_kv_dtype t) { return t == FR_KV_MXFP4 ? FR_MXFP4 : FR_NVFP4; }

fr_status fr_fp4_compute_parse(const char *s, fr_fp4_compute *out)
{
    if (s && strcmp(s, "exact") == 0) { *out = FR_COMPUTE_EXACT; return FR_OK; }
    if (s && strcmp(s, "bf16") == 0) { *out = FR_COMPUTE_BF16; return FR_OK; }
    if (s && strcmp(s, "auto") == 0) { *out = FR_COMPUTE_AUTO; return FR_OK; }
    return fr_fail(FR_EINVAL, "unknown fp4 compute mode '%s' (expected auto, exact or bf16)",
                   s ? s : "(null)");
}

const char *fr_fp4_compute_name(fr_fp4_compute c)
{
    return c == FR_COMPUTE_BF16 ? "bf16" : c == FR_COMPUTE_AUTO ? "auto" : "exact";
}

static const struct { const char *name; size_t offset; } switches[] = {
    {"smooth", offsetof(fr_recipe, smooth)},         {"rotate", offsetof(fr_recipe, rotate)},
    {"search", offsetof(fr_recipe, scale_search)},   {"dual", offsetof(fr_recipe, dual_query)},
    {"pscale", offsetof(fr_recipe, p_scaling)},      {"sink", offsetof(fr_recipe, sink_recent)},
    {"rowmax", offsetof(fr_recipe, p_row_max)},
};
enum { N_SWITCHES = sizeof switches / sizeof switches[0] };

fr_status fr_recipe_parse(const char *s, fr_recipe *out)
{
    if (!s) return fr_fail(FR_EINVAL, "recipe: NULL string");
    char buf[256];
    if (strlen(s) >= sizeof buf) return fr_fail(FR_EINVAL, "recipe string too long");
    strcpy(buf, s);
    char *save = NULL, *tok = strtok_r(buf, ",", &save);
    fr_recipe r;
    if (tok && strcmp(tok, "full") == 0) r = fr_recipe_full();
    else if (tok && strcmp(tok, "vanilla") == 0) r = fr_recipe_vanilla();
    else return fr_fail(FR_EINVAL, "recipe '%s' must start with 'full' or 'vanilla'", s);
    while ((tok = strtok_r(NULL, ",", &save))) {
        int on = tok[0] == '+';
        if (tok[0] != '+' && tok[0] != '-')
            return fr_fail(FR_EINVAL, "recipe switch '%s' must start with + or -", tok);
        int found = 0;
        for (int i = 0; i < N_SWITCHES; i++)
            if (strcmp(tok + 1, switches[i].name) == 0) {
                *(int *)((char *)&r + switches[i].offset) = on;
                found = 1;
            }
        if (!found)
            return fr_fail(FR_EINVAL, "unknown recipe switch '%s' (known: smooth, rotate, search, "
                                      "dual, pscale, sink, rowmax)", tok + 1);
    }
    *out = r;
    return FR_OK;
}

void fr_recipe_format(const fr_recipe *r, char *buf, int len)
{
    fr_recipe full = fr_recipe_full();
    int n = snprintf(buf, (size_t)len, "full");
    for (int i = 0; i < N_SWITCHES && n < len; i++) {
        int a = *(const int *)((const char *)r + switches[i].offset);
        int b = *(const int *)((const char *)&full + switches[i].offset);
        if (a != b) n += snprintf(buf + n, (size_t)(len - n), ",%c%s", a ? '+' : '-', switches[i].name);
    }
}
