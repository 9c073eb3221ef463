#include "rollout/model/ops_cpu.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

#include "base/fixed_math.h"
#include "rollout/model/rope_yarn.h"

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

/* Covers any real head_dim in one chunk (Qwen3 uses 128); larger ones are
 * done in chunks of the cos/sin table. */
#define ROPE_CHUNK 256

/* cos/sin for pair indices i0 .. i0+len (len <= ROPE_CHUNK) of a head, the
 * HF way (see header). */
static void rope_cos_sin_range(float *c, float *s, int i0, int len, int head_dim, int pos, double theta,
                               const fr_rope_scaling *y)
{
    float inv_freq[ROPE_CHUNK];
    fr_rope_inv_freq(inv_freq, i0, len, head_dim, theta, y);
    const int scaled = y && y->yarn;
    const float af = (float)fr_rope_attention_factor(y);
    float fpos = (float)pos;
    for (int j = 0; j < len; j++) {
        float angle = fpos * inv_freq[j];
        double sd, cd;
        fr_sincos((double)angle, &sd, &cd);
        c[j] = (float)cd;
        s[j] = (float)sd;
        if (scaled) {
            c[j] *= af;
            s[j] *= af;
        }
    }
}

void fr_rope_cos_sin(float *cos_out, float *sin_out, int head_dim, int pos, double theta, const fr_rope_scaling *y)
{
    if (head_dim < 2) return;
    const int h = head_dim / 2;
    for (int i0 = 0; i0 < h; i0 += ROPE_CHUNK)
        rope_cos_sin_range(cos_out + i0, sin_out + i0, i0, h - i0 < ROPE_CHUNK ? h - i0 : ROPE_CHUNK, head_dim, pos,
                           theta, y);
}

void fr_rope(float *x, int n_heads, int head_dim, int pos, double theta, const fr_rope_scaling *y)
{
    if (n_heads <= 0 || head_dim < 2) return;
    int h = head_dim / 2;
    float c[ROPE_CHUNK], s[ROPE_CHUNK];
    for (int i0 = 0; i0 < h; i0 += ROPE_CHUNK) {
        int len = h - i0 < ROPE_CHUNK ? h - i0 : ROPE_CHUNK;
        rope_cos_sin_range(c, s, i0, len, head_dim, pos, theta, y);
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
        float silu = g / (1.0f + fr_expf(-g));
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

/* The fixed-order dot product. Lane j (of FR_DOT_LANES = 8) sums the
 * products of indices k = j (mod 8) in increasing k; the lanes then meet in
 * a fixed tree. The two halves of the lanes are 4-float vectors: SSE2, which
 * every x86-64 CPU has, so the compiler emits the same instructions
 * everywhere, and a vector add rounds each lane like a scalar one. */
typedef float fr_v4 __attribute__((vector_size(16)));

static inline fr_v4 load4(const float *p)
{
    fr_v4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Lanes (lo = 0..3, hi = 4..7) after the main loop, the tail added to lane
 * k mod 8, then the tree ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)). */
static inline float lanes_finish(fr_v4 lo, fr_v4 hi, const float *x, const float *w, int k8, int K)
{
    float l[8];
    memcpy(l, &lo, sizeof lo);
    memcpy(l + 4, &hi, sizeof hi);
    for (int k = k8; k < K; k++) l[k - k8] += x[k] * w[k];
    float t0 = l[0] + l[4], t1 = l[1] + l[5], t2 = l[2] + l[6], t3 = l[3] + l[7];
    return (t0 + t2) + (t1 + t3);
}

float fr_dot_fixed(const float *x, const float *w, int K)
{
    const int k8 = K > 0 ? K / 8 * 8 : 0;
    fr_v4 lo = {0, 0, 0, 0}, hi = {0, 0, 0, 0};
    for (int k = 0; k < k8; k += 8) {
        lo += load4(x + k) * load4(w + k);
        hi += load4(x + k + 4) * load4(w + k + 4);
    }
    return lanes_finish(lo, hi, x, w, k8, K);
}

/* Four rows of x against one row of w: each w load serves four dot
 * products, and each product is the same as fr_dot_fixed's. */
static void dot4_fixed(const float *x, size_t ld, const float *w, int K, float *out, size_t ldo)
{
    const int k8 = K / 8 * 8;
    const float *x0 = x, *x1 = x + ld, *x2 = x + 2 * ld, *x3 = x + 3 * ld;
    fr_v4 a0 = {0, 0, 0, 0}, b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    for (int k = 0; k < k8; k += 8) {
        fr_v4 wl = load4(w + k), wh = load4(w + k + 4);
        a0 += load4(x0 + k) * wl; b0 += load4(x0 + k + 4) * wh;
        a1 += load4(x1 + k) * wl; b1 += load4(x1 + k + 4) * wh;
        a2 += load4(x2 + k) * wl; b2 += load4(x2 + k + 4) * wh;
        a3 += load4(x3 + k) * wl; b3 += load4(x3 + k + 4) * wh;
    }
    out[0] = lanes_finish(a0, b0, x0, w, k8, K);
    out[ldo] = lanes_finish(a1, b1, x1, w, k8, K);
    out[2 * ldo] = lanes_finish(a2, b2, x2, w, k8, K);
    out[3 * ldo] = lanes_finish(a3, b3, x3, w, k8, K);
}

void fr_dot_fixed_rows(float *out, const float *rows, size_t ld, int n_rows, const float *v, int K)
{
    int i = 0;
    /* x * w == w * x exactly, so each output is fr_dot_fixed(rows[i], v). */
    for (; i + 4 <= n_rows && K > 0; i += 4) dot4_fixed(rows + (size_t)i * ld, ld, v, K, out + i, 1);
    for (; i < n_rows; i++) out[i] = fr_dot_fixed(rows + (size_t)i * ld, v, K);
}

void fr_axpy(float *y, float a, const float *x, int n)
{
    int j = 0;
    const fr_v4 av = {a, a, a, a};
    for (; j + 4 <= n; j += 4) {
        fr_v4 r = load4(y + j) + av * load4(x + j);
        memcpy(y + j, &r, sizeof r);
    }
    for (; j < n; j++) y[j] += a * x[j];
}

/* Rows of x per pass over w: enough that a weight row is reused while
 * cached, few enough that the rows stay in L2. */
enum { FIXED_ROW_BLOCK = 32 };

void fr_matmul_fixed(float *y, const float *x, const float *w, int M, int N, int K)
{
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        memset(y, 0, (size_t)M * (size_t)N * sizeof *y);
        return;
    }
    for (int m0 = 0; m0 < M; m0 += FIXED_ROW_BLOCK) {
        int m1 = M - m0 < FIXED_ROW_BLOCK ? M : m0 + FIXED_ROW_BLOCK;
        for (int n = 0; n < N; n++) {
            const float *wn = w + (size_t)n * (size_t)K;
            int m = m0;
            for (; m + 4 <= m1; m += 4)
                dot4_fixed(x + (size_t)m * K, (size_t)K, wn, K, y + (size_t)m * N + n, (size_t)N);
            for (; m < m1; m++) y[(size_t)m * N + n] = fr_dot_fixed(x + (size_t)m * K, wn, K);
        }
    }
}
