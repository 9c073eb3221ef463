/* The three GEMM modes (rollout/model/gemm_cuda.h) side by side on one GPU:
 * cuBLASLt's heuristic per M (the default), cuBLASLt with one pinned
 * algorithm per (N, K), and the fixed-order kernel of deterministic mode, at
 * Qwen3-4B's decode shapes (M = the batch: 1, 16, 64), each against the byte
 * limit (weights + activations over the measured copy bandwidth), and whether
 * a row's bits stay the same at M = 1 and inside M = 64 (row 13).
 *
 * usage: gemm_modes [--reps N] [--markdown]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "rollout/model/gemm_cuda.h"
#include "bench/copy_bandwidth.h"

typedef struct {
    const char *name;
    int N, K, per_layer;   /* per_layer: 0 for the LM head */
} shape;

/* Qwen3-4B: hidden 2560, 32 query heads and 8 KV heads of 128, MLP 9728,
 * vocabulary 151,936, 36 layers; k and v are separate products. */
static const shape SHAPES[] = {{"q_proj", 4096, 2560, 1},   {"k_proj, v_proj", 1024, 2560, 2},
                               {"o_proj", 2560, 4096, 1},   {"gate|up", 19456, 2560, 1},
                               {"down_proj", 2560, 9728, 1}, {"lm_head", 151936, 2560, 0}};
static const char *const MODE_NAMES[] = {"cuBLASLt heuristic", "fixed-order kernel", "cuBLASLt pinned"};

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median time of reps calls, in ms (the weights are larger than L2, so every
 * call reads them from memory). */
static float time_gemm(fr_gemm *g, float *y, const uint16_t *x, const uint16_t *w, int M, int N, int K, int reps)
{
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float *t = malloc(sizeof(float) * (size_t)reps), med = -1.0f;
    for (int r = -3; r < reps; r++) {
        cudaEventRecord(e0, 0);
        if (fr_gemm_bf16(g, y, x, w, M, N, K, 0.0f, 0)) break;
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        if (r >= 0) cudaEventElapsedTime(&t[r], e0, e1);
        if (r == reps - 1) {
            qsort(t, (size_t)reps, sizeof(float), cmp_float);
            med = t[reps / 2];
        }
    }
    free(t);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return med;
}

/* Row 13 of the M = 64 product against the same row alone. */
static int row_invariant(fr_gemm *g, float *y, const uint16_t *x, const uint16_t *w, int N, int K)
{
    float *a = malloc(sizeof(float) * (size_t)N), *b = malloc(sizeof(float) * (size_t)N);
    int same = 0;
    if (a && b && !fr_gemm_bf16(g, y, x, w, 64, N, K, 0.0f, 0) &&
        cudaMemcpy(a, y + (size_t)13 * N, sizeof(float) * (size_t)N, cudaMemcpyDeviceToHost) == cudaSuccess &&
        !fr_gemm_bf16(g, y, x + (size_t)13 * K, w, 1, N, K, 0.0f, 0) &&
        cudaMemcpy(b, y, sizeof(float) * (size_t)N, cudaMemcpyDeviceToHost) == cudaSuccess)
        same = memcmp(a, b, sizeof(float) * (size_t)N) == 0;
    free(a);
    free(b);
    return same;
}

int main(int argc, char **argv)
{
    int reps = 50, markdown = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) reps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--markdown") == 0) markdown = 1;
        else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: gemm_modes [--reps N] [--markdown]\n"
                   "Times cuBLASLt (heuristic and pinned) against the fixed-order GEMM at Qwen3-4B's decode "
                   "shapes.\n");
            return 0;
        } else {
            fprintf(stderr, "usage: gemm_modes [--reps N] [--markdown]\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    const double bw = fr_bench_copy_bandwidth((size_t)1 << 30, 0);
    size_t max_w = 0, max_y = 0;
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) {
        size_t wn = (size_t)SHAPES[i].N * SHAPES[i].K, yn = (size_t)64 * SHAPES[i].N;
        max_w = wn > max_w ? wn : max_w;
        max_y = yn > max_y ? yn : max_y;
    }
    uint16_t *w, *x;
    float *y;
    fr_gemm *g;
    if (cudaMalloc((void **)&w, 2 * max_w) || cudaMalloc((void **)&x, 2 * (size_t)64 * 9728) ||
        cudaMalloc((void **)&y, 4 * max_y) || fr_gemm_new(0, &g)) {
        fprintf(stderr, "gemm_modes: cannot set up on the GPU\n");
        return 1;
    }
    /* Random BF16 values of either sign in [1/64, 1) (exponents 121..126), so
     * that the row check compares sums whose order matters. */
    uint16_t *h = malloc(2 * max_w);
    if (!h) return 1;
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < max_w; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        const unsigned bits = (unsigned)(r >> 33);
        h[i] = (uint16_t)((bits & 0x8000u) | ((121u + (bits >> 16) % 6u) << 7) | (bits & 0x7fu));
    }
    cudaMemcpy(w, h, 2 * max_w, cudaMemcpyHostToDevice);
    cudaMemcpy(x, h + 12345, 2 * (size_t)64 * 9728, cudaMemcpyHostToDevice);
    free(h);
    printf("copy bandwidth %.2f TB/s; median of %d calls\n\n", bw / 1e12, reps);
    if (markdown)
        printf("| product (N x K) | M | mode | us | of byte limit | row at M 1 = in M 64 |\n|---|---|---|---|---|---|\n");
    static const int Ms[] = {1, 16, 64};
    double layer_us[3][3] = {{0}}, head_us[3][3] = {{0}};
    for (size_t si = 0; si < sizeof SHAPES / sizeof SHAPES[0]; si++) {
        const shape *sh = &SHAPES[si];
        for (int mi = 0; mi < 3; mi++) {
            const int M = Ms[mi];
            const double bytes = 2.0 * sh->N * sh->K + 2.0 * M * sh->K + 4.0 * M * sh->N;
            for (int mode = 0; mode < 3; mode++) {
                if (fr_gemm_set_mode(g, (fr_gemm_mode)mode)) return 1;
                const float ms = time_gemm(g, y, x, w, M, sh->N, sh->K, reps);
                if (ms < 0) {
                    printf("%s M %d %s: %s\n", sh->name, M, MODE_NAMES[mode], fr_last_error());
                    continue;
                }
                const int inv = row_invariant(g, y, x, w, sh->N, sh->K);
                const double us = ms * 1e3, lim = bytes / bw * 1e6;
                if (sh->per_layer) layer_us[mode][mi] += sh->per_layer * us;
                else head_us[mode][mi] = us;
                if (markdown)
                    printf("| %s (%d x %d) | %d | %s | %.1f | %.0f%% | %s |\n", sh->name, sh->N, sh->K, M,
                           MODE_NAMES[mode], us, 100.0 * lim / us, inv ? "yes" : "no");
                else
                    printf("%-16s %6d x %5d  M %2d  %-20s %8.1f us  %5.0f%% of byte limit  row invariant: %s\n",
                           sh->name, sh->N, sh->K, M, MODE_NAMES[mode], us, 100.0 * lim / us, inv ? "yes" : "no");
            }
        }
    }
    printf("\nA decode step's products (36 layers + LM head), ms:\n");
    if (markdown) printf("\n| M | cuBLASLt heuristic | fixed-order kernel | cuBLASLt pinned | fixed / heuristic |\n"
                         "|---|---|---|---|---|\n");
    for (int mi = 0; mi < 3; mi++) {
        double t[3];
        for (int mode = 0; mode < 3; mode++) t[mode] = (36.0 * layer_us[mode][mi] + head_us[mode][mi]) / 1e3;
        if (markdown) printf("| %d | %.3f | %.3f | %.3f | %.2f |\n", Ms[mi], t[0], t[1], t[2], t[1] / t[0]);
        else printf("M %2d: heuristic %.3f, fixed %.3f, pinned %.3f (fixed / heuristic %.2f)\n", Ms[mi], t[0], t[1],
                    t[2], t[1] / t[0]);
    }
    fr_gemm_destroy(&g);
    cudaFree(w);
    cudaFree(x);
    cudaFree(y);
    return 0;
}
