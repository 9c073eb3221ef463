/* Byte layout of one KV cache block (docs/formats.md, "Page layout").
 *
 * A block holds one 128-token page of one sequence for every layer and KV
 * head. Inside it, the (layer, head) pages follow each other
 * (offset = (layer * n_kv_heads + head) * head_page_bytes), and each head page
 * is, for T = 128 tokens, head_dim d and FP4 block size B:
 *   FP4   K codes [T][d/8] | K scales [T][d/B] | V codes [d][T/8] | V scales [d][T/B]
 *         (codes in 32-bit code words of 8 elements, fr_fp4_word_pack)
 *   FP8   K [T][d] E4M3    | V [T][d] E4M3
 *   BF16  K [T][d] BF16    | V [T][d] BF16
 *   F32   K [T][d] float32 | V [T][d] float32 (CPU reference)
 * Keys are packed along head_dim (one scale per B channels of a token),
 * values along tokens (one scale per B tokens of a channel), as the two
 * attention products need them.
 *
 * A latent page (multi-head latent attention: one row per token, the latent
 * c of d_c channels then the RoPE key r of d_r; the model's one "KV head")
 * has no V half: both attention products read the latent along its channels.
 *   FP4   latent codes [T][d_c/8] | latent scales [T][d_c/B] | RoPE [T][d_r] BF16
 *   FP8   latent [T][d_c] E4M3    | RoPE [T][d_r] BF16
 *   BF16  latent [T][d_c] BF16    | RoPE [T][d_r] BF16
 *   F32   latent [T][d_c] float32 | RoPE [T][d_r] float32
 */
#ifndef FR_PAGE_LAYOUT_H
#define FR_PAGE_LAYOUT_H

#include <stddef.h>

#include "attention/kv_numerics.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    size_t k_codes, k_scales, v_codes, v_scales; /* offsets inside a head page */
    size_t rope;             /* latent pages: the RoPE rows; GQA pages: head_page_bytes */
    size_t head_page_bytes;
} fr_page_layout;

/* The layout for a dtype and head_dim (FP4 dtypes need d a multiple of B). */
fr_page_layout fr_page_layout_for(fr_kv_dtype t, int head_dim);
/* The latent page layout for a row of latent_dim + rope_dim values: k_codes
 * and k_scales hold the latent, rope the RoPE part; v_codes = v_scales =
 * rope (no V half). FP4 dtypes need latent_dim a multiple of B. */
fr_page_layout fr_page_layout_latent(fr_kv_dtype t, int latent_dim, int rope_dim);

#ifdef __cplusplus
}
#endif

#endif
