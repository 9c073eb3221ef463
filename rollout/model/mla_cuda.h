/* mla_cuda: multi-head latent attention (DeepSeek-V3) on the GPU, the CUDA
 * runner's layer for latent models; the numerics of rollout/model/mla_cpu.h
 * at BF16 level (docs/mla.md, docs/gpu_engine.md).
 *
 * One layer on a step's M rows (xn: the BF16 normed input):
 *   project  q = q_b(rmsnorm(q_a(xn))) (or q_proj(xn)), per head
 *            [content dn | RoPE dr]; rows = kv_a(xn) = [latent dc | RoPE dr],
 *            the latent RMS-normed in float32 (kv_a_layernorm), RoPE on the
 *            RoPE parts of the rows and of every head's query (with
 *            rope_interleave the pairs (2i, 2i+1) first moved to (i,
 *            i + dr/2), as mla_cpu.c does); the rows (float32) are what the
 *            cache stores (kvcache/kv_store_cuda.h makes their store form);
 *   absorb   the attention query [q_c | q_rope] per row and head, float32
 *            [M][H][dc + dr], q_c = W_UK_h^T q_content (the content query
 *            rounded to BF16, one strided-batched product over the heads;
 *            W_UK_h: kv_b rows h(dn+dv) .. +dn);
 *   attend   attention/attn_mla.h over the layer's latent pages, slots and
 *            staging rows: the context latent, BF16 [M][H][dc], rotated back
 *            and with the mean added;
 *   values   o_h = W_UV_h ctx_h (the next dv rows of kv_b), one batched
 *            product, BF16 [M][H*dv]: o_proj's input.
 * The kernel's numerics config comes from the cache's recipe the way
 * fr_kv_latent_form_of gives the CPU's: the mean with smoothing (FP4), the
 * rotation, the query's terms (exact compute: dual or single FP4; bf16
 * compute: BF16), the scale search, the BF16 sink and recent tokens (FP4
 * with the full recipe), the layer's FP8 scale (its K entry).
 *
 * Every buffer is allocated at creation. A decode step (one row per
 * sequence) allocates nothing and syncs nothing, so it can be captured in a
 * CUDA graph. A prefill step whose shape the attention workspace does not
 * fit grows it first (outside any capture; *grew tells the runner that its
 * captured graphs hold the old one).
 */
#ifndef FR_MLA_CUDA_H
#define FR_MLA_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "attention/paged_kv.h"
#include "base/fr_status.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_store_cuda.h"
#include "rollout/model/gemm_cuda.h"
#include "rollout/model/weights_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_mla_gpu fr_mla_gpu;

/* c: the rank's model config (its heads); book: the engine's cache (its
 * dtype, compute mode, recipe and FP8 scales); store: its device cache (the
 * latent mean the kernel adds back lives there); max_tokens: rows of a step.
 * max_seqs sizes the decode workspace. */
fr_status fr_mla_gpu_new(const fr_model_config *c, const fr_kv_cache *book, const fr_kv_store_gpu *store,
                         int max_tokens, int max_seqs, fr_mla_gpu **out);
void fr_mla_gpu_destroy(fr_mla_gpu **m);

/* Projections and RoPE of M rows (pos: device positions): rows, device
 * float32 [M][dc + dr] (the cache rows), and the query kept inside. */
fr_status fr_mla_gpu_project(fr_mla_gpu *m, fr_gemm *g, const fr_layer_weights_gpu *lw, const uint16_t *xn,
                             const int *pos, int M, float *rows, cudaStream_t stream);

/* The attention query of the M rows last projected (fr_mla_gpu_attn_query). */
fr_status fr_mla_gpu_absorb(fr_mla_gpu *m, fr_gemm *g, const fr_layer_weights_gpu *lw, int M,
                            cudaStream_t stream);

/* Attention of n_seqs sequences (device records, max_new rows at most
 * each, rows numbered by their q_row) over layer `layer` of store, with the
 * step's staging rows: q [rows][H][dc + dr] float32 -> ctx [rows][H][dc]
 * BF16. m supplies the numerics (its cache's) and the workspace. grew
 * (may be NULL) is set when the workspace had to grow for this call. */
fr_status fr_mla_gpu_attend(fr_mla_gpu *m, const fr_kv_store_gpu *store, int layer, const uint16_t *step_rows,
                            const fr_paged_seq *seqs, int n_seqs, int max_new, const float *q, uint16_t *ctx,
                            int *grew, cudaStream_t stream);

/* o = W_UV_h ctx_h for the M rows of fr_mla_gpu_context: out BF16 [M][H*dv]. */
fr_status fr_mla_gpu_values(fr_mla_gpu *m, fr_gemm *g, const fr_layer_weights_gpu *lw, int M, uint16_t *out,
                            cudaStream_t stream);

/* Device buffers: the attention query [max_tokens][H][dc + dr] and the
 * context [max_tokens][H][dc]. */
float *fr_mla_gpu_attn_query(const fr_mla_gpu *m);
uint16_t *fr_mla_gpu_context(const fr_mla_gpu *m);

#ifdef __cplusplus
}
#endif

#endif
