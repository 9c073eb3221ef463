#include "page_layout.h"

fr_page_layout fr_page_layout_for(fr_kv_dtype t, int head_dim)
{
    const size_t T = FR_PAGE_TOKENS, d = (size_t)head_dim;
    fr_page_layout l = {0};
    if (fr_kv_dtype_is_fp4(t)) {
        size_t B = (size_t)fr_fp4_block_size(fr_kv_dtype_fp4_format(t));
        l.k_codes = 0;
        l.k_scales = T * d / 2;
        l.v_codes = l.k_scales + T * d / B;
        l.v_scales = l.v_codes + d * T / 2;
        l.head_page_bytes = l.v_scales + d * T / B;
    } else {
        size_t elem = t == FR_KV_FP8 ? 1 : t == FR_KV_F32 ? 4 : 2;
        l.k_codes = 0;
        l.v_codes = T * d * elem;
        l.k_scales = l.v_scales = l.v_codes;   /* no per-page scales */
        l.head_page_bytes = 2 * T * d * elem;
    }
    l.rope = l.head_page_bytes;
    return l;
}

fr_page_layout fr_page_layout_latent(fr_kv_dtype t, int latent_dim, int rope_dim)
{
    const size_t T = FR_PAGE_TOKENS, dc = (size_t)latent_dim, dr = (size_t)rope_dim;
    fr_page_layout l = {0};
    size_t rope_elem = 2;   /* BF16, except the f32 reference */
    if (fr_kv_dtype_is_fp4(t)) {
        size_t B = (size_t)fr_fp4_block_size(fr_kv_dtype_fp4_format(t));
        l.k_scales = T * dc / 2;
        l.rope = l.k_scales + T * dc / B;
    } else {
        size_t elem = t == FR_KV_FP8 ? 1 : t == FR_KV_F32 ? 4 : 2;
        if (t == FR_KV_F32) rope_elem = 4;
        l.k_scales = l.rope = T * dc * elem;   /* no per-page scales */
    }
    l.v_codes = l.v_scales = l.rope;
    l.head_page_bytes = l.rope + T * dr * rope_elem;
    return l;
}
