#include "rollout/model/ops_cpu.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

void fr_rmsnorm(float *out, const float *x, const float *w, int rows, int n, float eps)
{
    if (rows <= 0 || n <= 0) return;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * (size_t)n;
        float *orow = out + (size_t)r * (size_t)n;
        /* torch: x.pow(2) in float32, then sum (a float32 cascade sum we
         * approximate by a double sum rounded once), then / n in float32. */
        double acc = 0.0;
        for (int i = 0; i < n; i++) {
            float sq = xr[i] * xr[i];
            acc += (double)sq;
        }
        float var = (float)acc / (float)n;
        float inv = 1.0f / sqrtf(var + eps);
        /* All reads of row r are done; writing in place is safe. */
        for (int i = 0; i < n; i++) {
            float t = xr[i] * inv;
            orow[i] = t * w[i];
        }
    }
}

/* cos/sin for pair indices i0 .. i0+len of a head, the HF way (see header). */
static void rope_cos_sin_range(float *c, float *s, int i0, int len, int head_dim, int pos, double theta)
{
    float base = (float)theta;
    float fpos = (float)pos;
    for (int j = 0; j < len; j++) {
        float expo = (float)(2 * (i0 + j)) / (float)head_dim;
        float inv_freq = 1.0f / powf(base, expo);
        float angle = fpos * inv_freq;
        c[j] = cosf(angle);
        s[j] = sinf(angle);
    }
}

void fr_rope_cos_sin(float *cos_out, float *sin_out, int head_dim, int pos, double theta)
{
    if (head_dim < 2) return;
    rope_cos_sin_range(cos_out, sin_out, 0, head_dim / 2, head_dim, pos, theta);
}

/* Covers any real head_dim in one chunk (Qwen3 uses 128); larger ones are
 * done in chunks of the cos/sin table. */
#define ROPE_CHUNK 256

void fr_rope(float *x, int n_heads, int head_dim, int pos, double theta)
{
    if (n_heads <= 0 || head_dim < 2) return;
    int h = head_dim / 2;
    float c[ROPE_CHUNK], s[ROPE_CHUNK];
    for (int i0 = 0; i0 < h; i0 += ROPE_CHUNK) {
        int len = h - i0 < ROPE_CHUNK ? h - i0 : ROPE_CHUNK;
        rope_cos_sin_range(c, s, i0, len, head_dim, pos, theta);
        for (int hd = 0; hd < n_heads; hd++) {
            float *xh = x + (size_t)hd * (size_t)head_dim;
            for (int j = 0; j < len; j++) {
                int i = i0 + j;
                float a = xh[i], b = xh[i + h];
                float ac = a * c[j], bs = b * s[j];
                float bc = b * c[j], as = a * s[j];
                xh[i] = ac - bs;
                xh[i + h] = bc + as;
            }
        }
    }
}

void fr_swiglu(float *out, const float *gate, const float *up, int n)
{
    for (int i = 0; i < n; i++) {
        float g = gate[i];
        float silu = g / (1.0f + expf(-g));
        out[i] = silu * up[i];
    }
}

void fr_matmul(float *y, const float *x, const float *w, int M, int N, int K)
{
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        memset(y, 0, (size_t)M * (size_t)N * sizeof *y);
        return;
    }
    if (M == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, N, K, 1.0f, w, K, x, 1, 0.0f, y, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N);
}

void fr_embed(float *out, const float *table, const int *ids, int n, int hidden)
{
    if (n <= 0 || hidden <= 0) return;
    size_t row = (size_t)hidden * sizeof *out;
    for (int t = 0; t < n; t++) {
        float *dst = out + (size_t)t * (size_t)hidden;
        if (ids[t] < 0)
            memset(dst, 0, row);
        else
            memcpy(dst, table + (size_t)ids[t] * (size_t)hidden, row);
    }
}
