/* The paged KV cache of one engine (one rank's KV heads).
 *
 * Lifecycle of a token's K and V (docs/formats.md):
 *  - during the step that computes them, attention reads them at the
 *    precision of the step's own activations (fr_kv_gather's step_k/step_v:
 *    float32 on the CPU, BF16 on the GPU), smoothed and rotated like stored
 *    keys (vanilla FP4 and FP8 quantize them on the fly like stored ones);
 *  - fr_kv_append then stores them, in "store form" (FP4 dtypes: key minus the
 *    calibrated mean, Hadamard-rotated), rounded to BF16 (f32: not rounded), in the sequence's
 *    recent slot, and the first 16 tokens also in its sink slot;
 *  - when a page's 128th token is appended, the page is promoted: quantized
 *    from the BF16 slot into the block reserved for it.
 * Attention reads full pages in the dtype's format, the sink and recent slot in
 * BF16 (full recipe) or quantized on the fly like a page (vanilla FP4, FP8).
 *
 * Samples of one prompt share its full pages (reference counted blocks) and
 * copy the slots.
 *
 * A latent cache (latent_dim > 0: multi-head latent attention, paper
 * Appendix G) holds one row per token, [latent c (latent_dim) | RoPE key r]
 * of head_dim values, as its single KV head, and no values. Its store form
 * (FP4 dtypes): c minus the calibrated latent mean, Hadamard-rotated over
 * latent_dim; r as computed. Pages hold c in the dtype's format, blocks along
 * the channels like keys, and r in BF16 (page_layout.h); the BF16 sink and
 * recent slots work as for keys. fr_kv_gather returns the rows in store form
 * (v_out unused, view->v = view->k); fr_kv_latent_form_of says how the
 * attention undoes the store form.
 */
#ifndef FR_KV_CACHE_H
#define FR_KV_CACHE_H

#include <stdint.h>

#include "attention/ref_attention.h"
#include "page_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int n_layers, n_kv_heads, head_dim;
    fr_kv_dtype dtype;
    fr_fp4_compute compute;
    fr_recipe recipe;
    float tau;                 /* P threshold (FR_P_TAU unless calibrated) */
    int n_blocks;              /* pool size in 128-token pages */
    int max_seqs;              /* sequences alive at once (slots) */
    const float *key_mean;     /* [layers][kv_heads][d], NULL = zeros; copied (a latent
                                  cache uses the first latent_dim of each row) */
    const float *fp8_scales;   /* [layers][kv_heads][2] (k, v), NULL = 1; copied (a latent
                                  cache scales its latent by the k entry) */
    /* > 0: a latent cache (above) with rows of latent_dim latent channels
     * then head_dim - latent_dim RoPE channels; needs n_kv_heads 1. */
    int latent_dim;
    /* 1: bookkeeping only (sequences, lengths, block tables) for a backend
     * that keeps the blocks and slots itself (the GPU); append then only
     * advances the length, and gather and fr_kv_page are unavailable. */
    int bookkeeping_only;
} fr_kv_cache_config;

typedef struct fr_kv_cache fr_kv_cache;

fr_status fr_kv_cache_new(const fr_kv_cache_config *cfg, fr_kv_cache **out);
void fr_kv_cache_destroy(fr_kv_cache **c);

/* Gives the memory of the pages and the sink and recent slots back while no
 * sequence is live (FR_EINVAL otherwise), for another user of the machine
 * (a trainer sharing it: the HTTP API's release_memory_occupation); the
 * cache must not be used until fr_kv_cache_restore_memory has made it again
 * (zeroed). A bookkeeping-only cache has nothing to give back. Both are
 * idempotent. */
fr_status fr_kv_cache_release_memory(fr_kv_cache *c);
fr_status fr_kv_cache_restore_memory(fr_kv_cache *c);
const fr_kv_cache_config *fr_kv_cache_config_of(const fr_kv_cache *c);
/* Replaces the key mean ([layers][kv_heads][d], copied; NULL: zeros) that
 * keys written from now on are smoothed with. Keys already stored keep the
 * old one, and attention needs one mean per sequence (the softmax is
 * invariant to q.mu only when every key of a sequence subtracts the same
 * mu): free or recompute every sequence first. Fails on a non-finite
 * element, changing nothing. */
fr_status fr_kv_cache_set_key_mean(fr_kv_cache *c, const float *key_mean);
const fr_page_layout *fr_kv_layout(const fr_kv_cache *c);
size_t fr_kv_block_bytes(const fr_kv_cache *c);
int fr_kv_free_blocks(const fr_kv_cache *c);

/* The attention parameters the cache's numerics imply for group size G. */
fr_attn_params fr_kv_attn_params(const fr_kv_cache *c, int group);

/* Sequences. */
fr_status fr_kv_seq_new(fr_kv_cache *c, int *seq);
/* A new sequence with src's tokens: full pages shared, slots copied. */
fr_status fr_kv_seq_fork(fr_kv_cache *c, int src, int *dst);
void fr_kv_seq_free(fr_kv_cache *c, int seq);
int fr_kv_seq_len(const fr_kv_cache *c, int seq);
/* Blocks the sequence needs to grow by n tokens (0 when already reserved). */
int fr_kv_blocks_needed(const fr_kv_cache *c, int seq, int n);
/* Reserves every block for tokens [0, len + n); all or nothing. */
fr_status fr_kv_reserve(fr_kv_cache *c, int seq, int n);

/* Store form of n key rows of one layer (in place, [n][kv_heads][d]):
 * FP4 dtypes subtract the key mean and rotate per the recipe; then every
 * dtype but f32 rounds to BF16. fr_kv_value_form only rounds. */
void fr_kv_key_form(const fr_kv_cache *c, int layer, int n, float *k);
void fr_kv_value_form(const fr_kv_cache *c, int n, float *v);
/* The query for an FP4 cache: rotated when the keys are ([rows][d]). A
 * latent cache leaves q alone: its absorbed query is formed in attention
 * (fr_kv_latent_form_of). */
void fr_kv_query_form(const fr_kv_cache *c, int rows, float *q);

/* How attention over a latent cache's rows (fr_kv_gather's view, store
 * form) is computed for one layer: the absorbed content query q_c and the
 * stored latents c' = H (c - mean) give q_c . c = (H q_c) . c' plus a term
 * the same for every token (the softmax drops it), and the context
 * sum_t p_t c_t = H (sum_t p_t c'_t) + mean. The FP4 pages' tokens
 * ([n_sink, fp4_end) of the view) meet the query terms of q_mode (exact
 * compute: dual-residual or single FP4 of H q_c), or H q_c rounded to BF16
 * (bf16 compute); every other token the plain query. The RoPE part is
 * never quantized, nor are the probabilities. */
typedef struct {
    int latent_dim;
    const float *mean;      /* [latent_dim] subtracted before storing; NULL: none */
    int rotate;             /* stored latents are Hadamard-rotated */
    fr_qquant_mode q_mode;  /* the content query's terms on FP4 pages */
    fr_fp4_format fmt;
    int q_search;           /* scale search for the query terms */
    int q_bf16;             /* the content query rounded to BF16 on FP4 pages */
} fr_kv_latent_form;

/* The form of layer's rows; latent_dim 0 for a GQA cache. */
fr_kv_latent_form fr_kv_latent_form_of(const fr_kv_cache *c, int layer);

/* Appends n tokens after the forward step that computed them. k and v are
 * raw post-RoPE keys and values, layer l at k + l * layer_stride, each
 * [n][kv_heads][d] (a latent cache: k the rows, v unused and may be NULL).
 * Needs fr_kv_reserve(c, seq, n) first. */
fr_status fr_kv_append(fr_kv_cache *c, int seq, int n, const float *k, const float *v,
                       size_t layer_stride);

/* The keys and values of (seq, layer, head) as attention sees them, for the
 * len stored tokens followed by n_step tokens of the current step (raw,
 * [n_step][kv_heads][d] at step_k/step_v; NULL when n_step is 0). k_out and
 * v_out hold (len + n_step) * d floats; view describes the regions. A latent
 * cache leaves v_out and step_v alone (either may be NULL). */
fr_status fr_kv_gather(const fr_kv_cache *c, int seq, int layer, int head, int n_step,
                       const float *step_k, const float *step_v, float *k_out, float *v_out,
                       fr_kv_view *view);

/* Raw access for byte-exact comparisons: the block holding page p of seq. */
const uint8_t *fr_kv_page(const fr_kv_cache *c, int seq, int page);

/* The block ids of seq's pages (reserved ones included) and their count; the
 * array stays valid until the sequence's table changes. NULL for a bad seq. */
const int *fr_kv_seq_blocks(const fr_kv_cache *c, int seq, int *n_blocks);

#ifdef __cplusplus
}
#endif

#endif
