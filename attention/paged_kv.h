/* How the GPU attention kernels find one layer's keys and values: the device
 * view of the paged cache (docs/formats.md, "Page layout" and "A token's way
 * into the cache"). Plain C structs passed by value to kernels; every pointer
 * is a device pointer.
 *
 * For a sequence with `len` tokens already cached and `n_new` tokens in this
 * step, token t is found at:
 *   t <  len / 128 * 128        its page in block block_table[t / 128]
 *                               (FP4 with the full recipe: tokens 0..15 from
 *                               the sink slot instead)
 *   len / 128 * 128 <= t < len  the sequence's recent slot, row t % 128
 *   len <= t < len + n_new      the step's staging rows q_row + (t - len)
 * Keys everywhere are in store form (FP4 dtypes: minus the key mean, rotated).
 */
#ifndef FR_PAGED_KV_H
#define FR_PAGED_KV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const int *block_table; /* the sequence's blocks: page p lives in block block_table[p] */
    int len;                /* tokens cached before this step */
    int n_new;              /* tokens of this step (1 for decode) */
    int q_row;              /* first row of this sequence's tokens in the step's q/staging */
    int slot;               /* the sequence's recent/sink slot index */
} fr_paged_seq;

typedef struct {
    const uint8_t *pool;     /* blocks of block_bytes each */
    size_t block_bytes;      /* head_page_bytes * n_layers * n_kv_heads */
    size_t head_page_bytes;  /* (layer, head) page: offset (layer * n_kv_heads + head) * head_page_bytes */
    size_t k_codes, k_scales, v_codes, v_scales; /* offsets inside a head page (kvcache/page_layout.h) */
    /* Recent slot of sequence slot s, K of (layer, head):
     *   recent + s * 2 * slot_elems + (layer * n_kv_heads + head) * 128 * head_dim, [128][d] BF16;
     * V the same plus slot_elems. Sink slots likewise with sink_elems and [16][d]. */
    const uint16_t *recent;
    const uint16_t *sink;
    size_t slot_elems, sink_elems;
    /* The step's keys and values in store form, BF16, [rows][n_kv_heads][d]. */
    const uint16_t *step_k, *step_v;
    int layer, n_layers, n_kv_heads, head_dim;
} fr_paged_kv;

#ifdef __cplusplus
}
#endif

#endif
