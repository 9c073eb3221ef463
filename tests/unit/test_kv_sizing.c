/* Sizing the KV cache by device memory (fr_kv_blocks_for_memory,
 * rollout/engine/session.h): the blocks kv_memory_fraction x total - (memory
 * in use) holds, for a GQA model (every layer's page of every KV head of the
 * rank) and a latent one (one latent row a layer), in each dtype; the cut
 * between the cache and a monitoring shadow's BF16 cache by kl_sample_rate;
 * the refusals (a share below one block per sequence slot, naming the
 * figures; a fraction outside (0, 1]; memory figures that contradict each
 * other). The device's figures are given here; reading them is
 * session_cuda.c's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "kvcache/page_layout.h"
#include "rollout/engine/session.h"
#include "test_util.h"

#define GB 1000000000ull

static fr_kv_sizing z;

static fr_status size(const fr_model_config *c, int heads, fr_kv_dtype dt, unsigned long long free_b,
                      unsigned long long total, double frac, double shadow, int max_seqs)
{
    return fr_kv_blocks_for_memory(c, heads, dt, (size_t)free_b, (size_t)total, frac, shadow, max_seqs, &z);
}

static void test_gqa_blocks(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_qwen3_4b_config(&c);   /* 36 layers, 8 KV heads, head_dim 128 */
    const fr_kv_dtype dts[] = {FR_KV_BF16, FR_KV_FP8, FR_KV_NVFP4, FR_KV_MXFP4};
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++) {
        /* 141 GB device, 9 GB in use: 0.9 x 141 - 9 = 117.9 GB for the cache */
        assert_int_equal(size(&c, 8, dts[i], 132 * GB, 141 * GB, 0.9, 0.0, 256), FR_OK);
        const size_t want_block = fr_page_layout_for(dts[i], 128).head_page_bytes * 36 * 8;
        assert_int_equal(z.block_bytes, want_block);
        assert_int_equal(z.n_blocks, (int)(117.9e9 / (double)want_block));
        assert_int_equal(z.shadow_blocks, 256);   /* no share: one block a slot, outside it */
        /* a tensor-parallel rank's share of the KV heads: blocks half the size */
        const int n = z.n_blocks;
        assert_int_equal(size(&c, 4, dts[i], 132 * GB, 141 * GB, 0.9, 0.0, 256), FR_OK);
        assert_true(z.n_blocks == 2 * n || z.n_blocks == 2 * n + 1);
    }
    /* BF16 pages: 128 tokens x 128 dims x 2 halves x 2 bytes = 64 KiB a head */
    assert_int_equal(size(&c, 8, FR_KV_BF16, 132 * GB, 141 * GB, 0.9, 0.0, 1), FR_OK);
    assert_int_equal(z.block_bytes, (size_t)65536 * 36 * 8);
    assert_int_equal(z.shadow_block_bytes, z.block_bytes);
}

/* With kl_sample_rate r the shadow takes r of the cache's blocks in BF16, and
 * both fit the share together. */
static void test_shadow_share(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_qwen3_4b_config(&c);
    assert_int_equal(size(&c, 8, FR_KV_NVFP4, 132 * GB, 141 * GB, 0.9, 0.0625, 256), FR_OK);
    const double room = 117.9e9, b = (double)z.block_bytes, sb = (double)z.shadow_block_bytes;
    assert_true(sb == 65536.0 * 36 * 8 && b < sb);
    assert_int_equal(z.n_blocks, (int)floor(room / (b + 0.0625 * sb)));
    assert_int_equal(z.shadow_blocks, (int)ceil(0.0625 * (room / (b + 0.0625 * sb))));
    assert_true((double)z.n_blocks * b + (double)z.shadow_blocks * sb <= room + sb);
    /* every sample monitored: as many shadow blocks as the cache's */
    assert_int_equal(size(&c, 8, FR_KV_NVFP4, 132 * GB, 141 * GB, 0.9, 1.0, 256), FR_OK);
    assert_true(z.shadow_blocks == z.n_blocks || z.shadow_blocks == z.n_blocks + 1);
    /* a small share still leaves the shadow one block a slot */
    assert_int_equal(size(&c, 8, FR_KV_NVFP4, 132 * GB, 141 * GB, 0.9, 1e-6, 256), FR_OK);
    assert_int_equal(z.shadow_blocks, 256);
    assert_int_equal(z.n_blocks, (int)floor((room - 256 * sb) / b));
}

static void test_latent_blocks(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_deepseek_v2_lite_config(&c);   /* 27 layers, latent 512, RoPE 64 */
    assert_int_equal(size(&c, 1, FR_KV_NVFP4, 100 * GB, 141 * GB, 0.9, 0.0, 64), FR_OK);
    assert_int_equal(z.block_bytes, (size_t)416 * 128 * 27);   /* docs/formats.md: 416 bytes a token at d_c 512 */
    assert_int_equal(z.n_blocks, (int)((0.9 * 141e9 - 41e9) / (double)z.block_bytes));
    assert_int_equal(z.shadow_block_bytes, (size_t)1152 * 128 * 27);
    assert_int_equal(size(&c, 1, FR_KV_BF16, 100 * GB, 141 * GB, 0.9, 0.0, 64), FR_OK);
    assert_int_equal(z.block_bytes, (size_t)1152 * 128 * 27);
}

static void test_refusals(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_qwen3_4b_config(&c);
    z.n_blocks = 7;
    /* the weights take more than the share: no room at all */
    assert_int_equal(size(&c, 8, FR_KV_BF16, 10 * GB, 80 * GB, 0.5, 0.0, 16), FR_ENOMEM);
    fr_test_error_has("kv_memory_fraction 0.5 of the device's 80.00 GB is 40.00 GB, and 70.00 GB are in use");
    fr_test_error_has("fewer than the 16 sequence slots");
    assert_int_equal(z.n_blocks, 7);
    /* room for some blocks, but not one per slot: 1 GB over 18.9 MB blocks is 52 */
    assert_int_equal(size(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.125, 0.0, 64), FR_ENOMEM);
    fr_test_error_has("room for 52 KV blocks");
    assert_int_equal(size(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.125, 0.0, 52), FR_OK);
    assert_int_equal(z.n_blocks, 52);
    /* the shadow's part leaves the cache too little */
    assert_int_equal(size(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.125, 1.0, 52), FR_ENOMEM);
    fr_test_error_has("beside the monitoring shadow's");
    const double bad[] = {0.0, -0.5, 1.5};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(size(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, bad[i], 0.0, 1), FR_EINVAL);
        fr_test_error_has("is not in (0, 1]");
    }
    assert_int_equal(size(&c, 8, FR_KV_BF16, 81 * GB, 80 * GB, 0.5, 0.0, 1), FR_EINVAL);
    assert_int_equal(size(&c, 0, FR_KV_BF16, 71 * GB, 80 * GB, 0.5, 0.0, 1), FR_EINVAL);
    assert_int_equal(size(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.5, -1.0, 1), FR_EINVAL);
    assert_int_equal(size(NULL, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.5, 0.0, 1), FR_EINVAL);
    assert_int_equal(fr_kv_blocks_for_memory(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.5, 0.0, 1, NULL), FR_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gqa_blocks),
        cmocka_unit_test(test_shadow_share),
        cmocka_unit_test(test_latent_blocks),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
