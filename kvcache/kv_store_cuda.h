/* The GPU side of the paged KV cache: the device block pool, the BF16 recent
 * and sink slots, and the store path that writes them, byte for byte what the
 * CPU cache (kv_cache.h) writes for the same float32 inputs.
 *
 * The CPU cache keeps the bookkeeping (sequences, lengths, block tables,
 * reservation: a bookkeeping-only fr_kv_cache); this object keeps the bytes.
 * A forward step goes, for every layer (docs/formats.md, "On the GPU"):
 *   1. fr_kv_store_gpu_stage: the step's K and V rows into store form, BF16,
 *      in the step's staging buffers; attention reads the step's own tokens
 *      from there (fr_kv_store_gpu_view);
 *   2. attention of the layer;
 *   3. fr_kv_store_gpu_commit: pages the step completes are promoted
 *      (quantized from the recent slot and the staging rows into their
 *      blocks), then the new tokens of the last partial page go to the
 *      recent slot and tokens 0..15 to the sink slot.
 * Forking a sequence copies its slots (fr_kv_store_gpu_copy_slot); its full
 * pages are shared through the block table.
 *
 * stage, commit and copy_slot only enqueue work on the given stream: no host
 * synchronization, no allocation, so a step can be captured in a CUDA graph.
 * Argument errors are reported on the host. What only the device can see is
 * skipped, never written out of bounds, and reported by
 * fr_kv_store_gpu_check: a record with a slot out of range, a negative
 * field or more completed pages than the launch allows is skipped whole; a
 * missing or out-of-range block id skips that page's promotion.
 *
 * The f32 dtype is the CPU's exact reference and has no GPU store.
 *
 * A latent cache (cfg->latent_dim > 0, one KV head: multi-head latent
 * attention) keeps one row per token, [latent | RoPE], and no V: the slots
 * have one half (attention/attn_mla.h, fr_latent_kv, says where each row
 * is), stage takes the rows alone (store form: FP4 dtypes subtract the
 * latent mean and rotate over latent_dim; the RoPE part untouched), and the
 * pages are kv_cache.c's latent pages (write_latent_page), byte for byte.
 */
#ifndef FR_KV_STORE_CUDA_H
#define FR_KV_STORE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "base/fr_status.h"
#include "attention/attn_mla.h"
#include "attention/paged_kv.h"
#include "kv_cache.h"
#include "page_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_kv_store_gpu fr_kv_store_gpu;

/* Allocates on the current device the block pool (cfg->n_blocks blocks of
 * the layout's block bytes, zeroed), the recent and sink slots of
 * cfg->max_seqs sequences (BF16, zeroed, laid out as attention/paged_kv.h
 * says), and copies the key mean and FP8 scales (NULL: zeros and 1.0).
 * cfg->bookkeeping_only is ignored. Fails with FR_EUNSUPPORTED for f32. */
fr_status fr_kv_store_gpu_new(const fr_kv_cache_config *cfg, fr_kv_store_gpu **out);
void fr_kv_store_gpu_destroy(fr_kv_store_gpu **s);
/* Frees the pages and the sink and recent slots (the key mean, FP8 scales
 * and error flag stay), and allocates them again, zeroed, possibly at other
 * addresses: whoever captured them (a decode graph) must drop them. For an
 * idle engine only; both idempotent. */
fr_status fr_kv_store_gpu_release(fr_kv_store_gpu *s);
fr_status fr_kv_store_gpu_restore(fr_kv_store_gpu *s);
/* Replaces the device key mean (host [layers][kv_heads][d]; NULL: zeros) in
 * place, so captured graphs stay valid; synchronous. The caller makes sure
 * no step is in flight and that no sequence holds keys smoothed with the
 * old mean (kvcache/kv_cache.h, fr_kv_cache_set_key_mean). */
fr_status fr_kv_store_gpu_set_key_mean(fr_kv_store_gpu *s, const float *key_mean);

/* The attention view of one layer, with the step's staging buffers
 * (device pointers, [rows][n_kv_heads][head_dim] BF16; NULL when there are
 * none). A layer out of range gives a view with pool NULL. */
fr_paged_kv fr_kv_store_gpu_view(const fr_kv_store_gpu *s, int layer, const uint16_t *step_k,
                                 const uint16_t *step_v);

/* The latent attention view of one layer (latent caches), with the step's
 * staging rows (device [rows][head_dim] BF16). pool NULL for a GQA cache or
 * a layer out of range. */
fr_latent_kv fr_kv_store_gpu_latent_view(const fr_kv_store_gpu *s, int layer, const uint16_t *step_rows);

/* Step 1, before attention of `layer`: k and v are the step's rows, device
 * float32 [rows][n_kv_heads][head_dim], post-RoPE; writes their store form
 * (FP4 dtypes: key minus the key mean when the recipe smooths, then the
 * normalized Hadamard when it rotates; then every value rounded to BF16) to
 * step_k and step_v, device BF16 bits of the same shape. rows 0 does nothing.
 * step_k/step_v are the staging buffers commit reads after attention.
 * A latent cache takes its rows in k and step_k; v and step_v are unused
 * (may be NULL). */
fr_status fr_kv_store_gpu_stage(const fr_kv_store_gpu *s, int layer, int rows, const float *k,
                                const float *v, uint16_t *step_k, uint16_t *step_v,
                                cudaStream_t stream);

/* Step 3, after attention of `layer`: seqs is a device array of n_seqs
 * records (paged_kv.h: block_table, len = tokens cached before the step,
 * n_new, q_row = the sequence's first staging row, slot), read on the
 * device. For each sequence, every page p with len/128 <= p < (len+n_new)/128
 * is promoted into block block_table[p] (token t from the recent slot when
 * t < len, else from staging row q_row + t - len); then the new tokens of
 * the last partial page go to recent slot rows t % 128, and new tokens
 * t < 16 to the sink slot. Recent slot rows of tokens not in the partial
 * page are left as they are (attention never reads them).
 * max_pages_per_seq bounds the pages one sequence completes in this step:
 * ceil(largest n_new / 128) always suffices (decode steps: 1). A sequence
 * that needs more is skipped and reported by fr_kv_store_gpu_check.
 * n_seqs 0 does nothing; n_seqs may not exceed cfg->max_seqs. A latent
 * cache reads step_k alone (step_v may be NULL). */
fr_status fr_kv_store_gpu_commit(const fr_kv_store_gpu *s, int layer, const fr_paged_seq *seqs,
                                 int n_seqs, int max_pages_per_seq, const uint16_t *step_k,
                                 const uint16_t *step_v, cudaStream_t stream);

/* Fork support: copies slot src's recent and sink slots (every layer) to
 * slot dst, asynchronously on the stream. */
fr_status fr_kv_store_gpu_copy_slot(const fr_kv_store_gpu *s, int src_slot, int dst_slot,
                                    cudaStream_t stream);

/* Waits for the stream, then reports (and clears) what commit found wrong on
 * the device since the last check: FR_EINTERNAL naming the problems, or
 * FR_OK. Not for use inside a graph capture. */
fr_status fr_kv_store_gpu_check(const fr_kv_store_gpu *s, cudaStream_t stream);

/* ---- accessors (device pointers) ---- */

const fr_kv_cache_config *fr_kv_store_gpu_config(const fr_kv_store_gpu *s); /* key_mean/fp8_scales NULL */
const fr_page_layout *fr_kv_store_gpu_layout(const fr_kv_store_gpu *s);
size_t fr_kv_store_gpu_block_bytes(const fr_kv_store_gpu *s);
uint8_t *fr_kv_store_gpu_pool(const fr_kv_store_gpu *s);
/* The FP8 K and V scales on the device, [layers][kv_heads][2] (1.0 unless configured). */
const float *fr_kv_store_gpu_fp8_scales(const fr_kv_store_gpu *s);
/* The key mean on the device, [layers][kv_heads][d] (zeros unless configured). */
const float *fr_kv_store_gpu_key_mean(const fr_kv_store_gpu *s);
/* Block `block` of the pool, NULL when out of range. */
uint8_t *fr_kv_store_gpu_block(const fr_kv_store_gpu *s, int block);
/* Slot `slot`'s recent slot: K [layers][kv_heads][128][d] BF16, then V
 * (slot_elems further; a latent cache has no V); the sink likewise with
 * [16] rows and sink_elems. NULL when out of range. */
uint16_t *fr_kv_store_gpu_recent(const fr_kv_store_gpu *s, int slot);
uint16_t *fr_kv_store_gpu_sink(const fr_kv_store_gpu *s, int slot);
size_t fr_kv_store_gpu_slot_elems(const fr_kv_store_gpu *s);
size_t fr_kv_store_gpu_sink_elems(const fr_kv_store_gpu *s);

#ifdef __cplusplus
}
#endif

#endif
