/* Sizing the KV cache by device memory (fr_kv_blocks_for_memory,
 * rollout/engine/session.h): the blocks kv_memory_fraction x total - (memory
 * in use) holds, for a GQA model (every layer's page of every KV head of the
 * rank) and a latent one (one latent row a layer), in each dtype; the
 * refusals (a share below one block per sequence slot, naming the figures;
 * a fraction outside (0, 1]; memory figures that contradict each other). The
 * device's figures are given here; reading them is session_cuda.c's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "kvcache/page_layout.h"
#include "rollout/engine/session.h"
#include "test_util.h"

#define GB 1000000000ull

static void test_gqa_blocks(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_qwen3_4b_config(&c);   /* 36 layers, 8 KV heads, head_dim 128 */
    const fr_kv_dtype dts[] = {FR_KV_BF16, FR_KV_FP8, FR_KV_NVFP4, FR_KV_MXFP4};
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++) {
        int n = 0;
        size_t block = 0;
        /* 141 GB device, 9 GB in use: 0.9 x 141 - 9 = 117.9 GB for the cache */
        assert_int_equal(fr_kv_blocks_for_memory(&c, 8, dts[i], 132 * GB, 141 * GB, 0.9, 256, &n, &block), FR_OK);
        const size_t want_block = fr_page_layout_for(dts[i], 128).head_page_bytes * 36 * 8;
        assert_int_equal(block, want_block);
        assert_int_equal(n, (int)(117.9e9 / (double)want_block));
        /* a tensor-parallel rank's share of the KV heads: blocks half the size */
        int n2 = 0;
        assert_int_equal(fr_kv_blocks_for_memory(&c, 4, dts[i], 132 * GB, 141 * GB, 0.9, 256, &n2, NULL), FR_OK);
        assert_true(n2 == 2 * n || n2 == 2 * n + 1);
    }
    /* BF16 pages: 128 tokens x 128 dims x 2 halves x 2 bytes = 64 KiB a head */
    size_t block = 0;
    int n = 0;
    assert_int_equal(fr_kv_blocks_for_memory(&c, 8, FR_KV_BF16, 132 * GB, 141 * GB, 0.9, 1, &n, &block), FR_OK);
    assert_int_equal(block, (size_t)65536 * 36 * 8);
}

static void test_latent_blocks(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_deepseek_v2_lite_config(&c);   /* 27 layers, latent 512, RoPE 64 */
    int n = 0;
    size_t block = 0;
    assert_int_equal(fr_kv_blocks_for_memory(&c, 1, FR_KV_NVFP4, 100 * GB, 141 * GB, 0.9, 64, &n, &block), FR_OK);
    assert_int_equal(block, (size_t)416 * 128 * 27);   /* docs/formats.md: 416 bytes a token at d_c 512 */
    assert_int_equal(n, (int)((0.9 * 141e9 - 41e9) / (double)block));
    assert_int_equal(fr_kv_blocks_for_memory(&c, 1, FR_KV_BF16, 100 * GB, 141 * GB, 0.9, 64, &n, &block), FR_OK);
    assert_int_equal(block, (size_t)1152 * 128 * 27);
}

static void test_refusals(void **state)
{
    (void)state;
    fr_model_config c;
    fr_synthetic_qwen3_4b_config(&c);
    int n = 7;
    /* the weights take more than the share: no room at all */
    assert_int_equal(fr_kv_blocks_for_memory(&c, 8, FR_KV_BF16, 10 * GB, 80 * GB, 0.5, 16, &n, NULL), FR_ENOMEM);
    fr_test_error_has("kv_memory_fraction 0.5 of the device's 80.00 GB is 40.00 GB, and 70.00 GB are in use");
    fr_test_error_has("fewer than the 16 sequence slots");
    assert_int_equal(n, 7);
    /* room for some blocks, but not one per slot: 1 GB over 18.9 MB blocks is 52 */
    assert_int_equal(fr_kv_blocks_for_memory(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.125, 64, &n, NULL), FR_ENOMEM);
    fr_test_error_has("room for 52 KV blocks");
    assert_int_equal(fr_kv_blocks_for_memory(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.125, 52, &n, NULL), FR_OK);
    assert_int_equal(n, 52);
    const double bad[] = {0.0, -0.5, 1.5};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(fr_kv_blocks_for_memory(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, bad[i], 1, &n, NULL), FR_EINVAL);
        fr_test_error_has("is not in (0, 1]");
    }
    assert_int_equal(fr_kv_blocks_for_memory(&c, 8, FR_KV_BF16, 81 * GB, 80 * GB, 0.5, 1, &n, NULL), FR_EINVAL);
    assert_int_equal(fr_kv_blocks_for_memory(&c, 0, FR_KV_BF16, 71 * GB, 80 * GB, 0.5, 1, &n, NULL), FR_EINVAL);
    assert_int_equal(fr_kv_blocks_for_memory(NULL, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.5, 1, &n, NULL), FR_EINVAL);
    assert_int_equal(fr_kv_blocks_for_memory(&c, 8, FR_KV_BF16, 71 * GB, 80 * GB, 0.5, 1, NULL, NULL), FR_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gqa_blocks),
        cmocka_unit_test(test_latent_blocks),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
