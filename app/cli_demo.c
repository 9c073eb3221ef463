/* fp4rollout demo: the quantizers and the Algorithm 1 reference on a demo
 * tensor shaped like real keys (a static per-channel bias, a few outlier
 * channels, token-dependent spikes), printed as error tables. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention/hadamard.h"
#include "attention/ref_attention.h"
#include "app/cli.h"

enum { N_TOK = 1024, D = 128, G = 4, N_QUERY = 8 };

const char fr_demo_usage[] =
    "usage: fp4rollout demo [--seed S]\n"
    "\n"
    "Builds a demo key/value tensor (1024 tokens x 128 channels, outlier\n"
    "channels and spikes like real post-RoPE keys) and prints:\n"
    "  1. the relative RMS error of NVFP4 and MXFP4 keys with and without\n"
    "     scale search, key smoothing and Hadamard rotation;\n"
    "  2. the relative error of decode attention (paper Algorithm 1) against\n"
    "     BF16 KV for each KV configuration.\n";

static uint64_t rng_state;
static float uniform(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (float)((z ^ (z >> 31)) >> 40) * 0x1p-24f;
}
static float normal(void)
{
    float u = uniform();
    return sqrtf(-2.0f * logf(u > 1e-12f ? u : 1e-12f)) * cosf(6.2831853f * uniform());
}

static void make_tensors(float *k, float *v, float *q, float *mu)
{
    float bias[D];
    for (int j = 0; j < D; j++) bias[j] = (j % 37 == 3) ? 12.0f * normal() : 0.5f * normal();
    for (int t = 0; t < N_TOK; t++)
        for (int j = 0; j < D; j++) {
            float spike = uniform() < 0.01f ? 8.0f * normal() : 0.0f;
            k[t * D + j] = bias[j] + normal() + spike;
            v[t * D + j] = normal();
        }
    for (int i = 0; i < N_QUERY * G * D; i++) q[i] = normal();
    for (int j = 0; j < D; j++) {
        double s = 0;
        for (int t = 0; t < N_TOK; t++) s += k[t * D + j];
        mu[j] = (float)(s / N_TOK);
    }
}

static double rel_err(const float *a, const float *ref, int n)
{
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        num += (double)(a[i] - ref[i]) * (a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static float amax(const float *x, int n)
{
    float m = 0.0f;
    for (int i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}

/* Errors are relative to the original keys: smoothing shifts every key of a
 * query equally and the rotation is orthonormal, so the error in the
 * transformed space is the error the logits see. */
static void key_table(const float *k, const float *mu)
{
    float *x = malloc(sizeof(float) * N_TOK * D * 2), *y = x + N_TOK * D;
    printf("Key quantization, relative RMS error (%d tokens x %d channels)\n", N_TOK, D);
    printf("%-8s %-22s %10s %10s\n", "format", "transform", "standard", "search");
    const char *names[] = {"none", "smooth", "smooth + Hadamard"};
    for (int f = 0; f < 2; f++)
        for (int tr = 0; tr < 3; tr++) {
            memcpy(x, k, sizeof(float) * N_TOK * D);
            for (int t = 0; t < N_TOK; t++) {
                if (tr >= 1) for (int j = 0; j < D; j++) x[t * D + j] -= mu[j];
                if (tr == 2) fr_hadamard(x + t * D, D);
            }
            double e[2];
            for (int s = 0; s < 2; s++) {
                for (int t = 0; t < N_TOK; t++)
                    fr_fp4_fake_quantize((fr_fp4_format)f, s, x + t * D, D, y + t * D);
                double num = 0, den = 0;
                for (int i = 0; i < N_TOK * D; i++) {
                    num += (double)(y[i] - x[i]) * (y[i] - x[i]);
                    den += (double)k[i] * k[i];
                }
                e[s] = sqrt(num / den);
            }
            printf("%-8s %-22s %10.4f %10.4f\n", fr_fp4_format_name((fr_fp4_format)f), names[tr], e[0], e[1]);
        }
    free(x);
}

static int attention_table(const float *k, const float *v, const float *q, const float *mu)
{
    struct { const char *name; fr_kv_dtype dt; fr_fp4_compute comp; const char *recipe; } rows[] = {
        {"fp8 (E4M3)", FR_KV_FP8, FR_COMPUTE_EXACT, "full"},
        {"nvfp4 vanilla", FR_KV_NVFP4, FR_COMPUTE_EXACT, "vanilla"},
        {"nvfp4 full, exact", FR_KV_NVFP4, FR_COMPUTE_EXACT, "full"},
        {"nvfp4 full, bf16 compute", FR_KV_NVFP4, FR_COMPUTE_BF16, "full"},
        {"mxfp4 vanilla", FR_KV_MXFP4, FR_COMPUTE_EXACT, "vanilla"},
        {"mxfp4 full, exact", FR_KV_MXFP4, FR_COMPUTE_EXACT, "full"},
        {"mxfp4 full, bf16 compute", FR_KV_MXFP4, FR_COMPUTE_BF16, "full"},
    };
    size_t kvn = (size_t)N_TOK * D;
    float *kb = malloc(sizeof(float) * kvn * 4), *vb = kb + kvn, *kq = vb + kvn, *vq = kq + kvn;
    float ref[N_QUERY * G * D], out[N_QUERY * G * D], qr[G * D], lse[G];
    fr_ref_config bf = fr_ref_config_default(FR_KV_BF16);
    fr_kv_view view;
    int rc = 0;
    fr_attn_params p = fr_ref_attn_params(&bf, D, G);
    if (fr_ref_prepare_kv(&bf, D, N_TOK, k, v, mu, kb, vb, &view)) rc = 1;
    for (int i = 0; !rc && i < N_QUERY; i++)
        if (fr_ref_attn_decode(&p, q + i * G * D, &view, 4, ref + i * G * D, lse)) rc = 1;
    printf("\nDecode attention (Algorithm 1), relative error against BF16 KV, G = %d, %d tokens\n", G, N_TOK);
    printf("%-26s %12s\n", "KV configuration", "rel. error");
    for (size_t r = 0; !rc && r < sizeof rows / sizeof rows[0]; r++) {
        fr_ref_config cfg = fr_ref_config_default(rows[r].dt);
        cfg.compute = rows[r].comp;
        if (fr_recipe_parse(rows[r].recipe, &cfg.recipe)) { rc = 1; break; }
        if (rows[r].dt == FR_KV_FP8) {  /* per-head scales from the tensor's range */
            cfg.fp8_k_scale = amax(k, (int)kvn) / 448.0f;
            cfg.fp8_v_scale = amax(v, (int)kvn) / 448.0f;
        }
        p = fr_ref_attn_params(&cfg, D, G);
        if (fr_ref_prepare_kv(&cfg, D, N_TOK, k, v, mu, kq, vq, &view)) { rc = 1; break; }
        for (int i = 0; !rc && i < N_QUERY; i++)
            if (fr_ref_prepare_query(&cfg, D, G, q + i * G * D, qr) ||
                fr_ref_attn_decode(&p, qr, &view, 4, out + i * G * D, lse))
                rc = 1;
        if (!rc) printf("%-26s %12.5f\n", rows[r].name, rel_err(out, ref, N_QUERY * G * D));
    }
    if (rc) fprintf(stderr, "fp4rollout demo: %s\n", fr_last_error());
    free(kb);
    return rc;
}

int fr_cli_demo(const fr_cli_values *opts)
{
    rng_state = (uint64_t)fr_opt_int(opts, FR_O_DEMO_SEED);
    float *k = malloc(sizeof(float) * (N_TOK * D * 2 + N_QUERY * G * D + D));
    if (!k) { fprintf(stderr, "fp4rollout demo: out of memory\n"); return 1; }
    float *v = k + N_TOK * D, *q = v + N_TOK * D, *mu = q + N_QUERY * G * D;
    make_tensors(k, v, q, mu);
    key_table(k, mu);
    int rc = attention_table(k, v, q, mu);
    free(k);
    return rc;
}
