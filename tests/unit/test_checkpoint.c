/* Checkpoint folders: single file and sharded, their defects, and tq6. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rollout/model/checkpoint.h"
#include "tests/unit/test_util.h"
#include "test_util.h"

static const char *CONFIG =
    "{\"architectures\":[\"Qwen3ForCausalLM\"],\"model_type\":\"qwen3\",\"vocab_size\":8,"
    "\"hidden_size\":4,\"num_hidden_layers\":1,\"num_attention_heads\":2,\"num_key_value_heads\":1,"
    "\"head_dim\":2,\"intermediate_size\":8,\"max_position_embeddings\":64,\"rms_norm_eps\":1e-5,"
    "\"rope_theta\":10000,\"eos_token_id\":[6,7],\"bos_token_id\":5}";

/* Three tensors: a BF16 [2,3] = 1..6, b F32 [4] = -1..-4, c I32 [2]. */
#define HDR_A "\"a\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]}"
#define HDR_B "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}"
#define HDR_C "\"c\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[16,24]}"

static char tmpdir[] = "/tmp/fr_ck_XXXXXX";

static int make_dir(void **state)
{
    (void)state;
    return mkdtemp(tmpdir) ? 0 : -1;
}

static void clear_dir(const char *dir, int remove_self) { fr_test_clear_dir(dir, remove_self); }

static int remove_dir(void **state)
{
    (void)state;
    clear_dir(tmpdir, 1);
    return 0;
}

/* Each test starts from an empty folder. */
static int empty_dir(void **state)
{
    (void)state;
    clear_dir(tmpdir, 0);
    return 0;
}

static void write_file(const char *name, const void *buf, size_t len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(buf, 1, len, fp), len);
    fclose(fp);
}

static void write_text(const char *name, const char *text) { write_file(name, text, strlen(text)); }

/* Writes a safetensors file from a header body (without braces) and data. */
static void write_st(const char *name, const char *entries, const uint8_t *data, size_t data_len)
{
    char hdr[1024];
    snprintf(hdr, sizeof hdr, "{%s}", entries);
    size_t hl = strlen(hdr), len = 8 + hl + data_len;
    uint8_t *b = malloc(len);
    assert_non_null(b);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, hdr, hl);
    if (data_len) memcpy(b + 8 + hl, data, data_len);
    write_file(name, b, len);
    free(b);
}

static void put_f32(uint8_t *p, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    for (int k = 0; k < 4; k++) p[k] = (uint8_t)(u >> (8 * k));
}

/* Data for a (bf16 1..6) followed by c (two I32). */
static void data_ac(uint8_t d[24])
{
    memset(d, 0, 24);
    for (int i = 0; i < 6; i++) {
        uint8_t f[4];
        put_f32(f, (float)(i + 1));
        d[2 * i] = f[2], d[2 * i + 1] = f[3]; /* bf16 = top half */
    }
    d[16] = 9, d[20] = 10;
}

static void data_b(uint8_t d[16])
{
    for (int i = 0; i < 4; i++) put_f32(d + 4 * i, -(float)(i + 1));
}

static fr_checkpoint *open_ok(void)
{
    fr_checkpoint *c = NULL;
    if (fr_checkpoint_open(tmpdir, &c) != FR_OK) fail_msg("open: %s", fr_last_error());
    return c;
}

static void check_a_b_c(fr_checkpoint *c, const char *shard_of_a)
{
    float v[6];
    const int64_t sa[2] = {2, 3}, sb[1] = {4}, wrong[2] = {3, 2};
    assert_int_equal(fr_checkpoint_load_f32(c, "a", 2, sa, v), FR_OK);
    for (int i = 0; i < 6; i++) assert_true(v[i] == (float)(i + 1));
    assert_int_equal(fr_checkpoint_load_f32(c, "b", 1, sb, v), FR_OK);
    assert_true(v[0] == -1.0f && v[3] == -4.0f);
    assert_non_null(fr_checkpoint_find(c, "c"));
    assert_null(fr_checkpoint_find(c, "d"));

    assert_int_equal(fr_checkpoint_load_f32(c, "a", 2, wrong, v), FR_EFORMAT);
    fr_test_error_has(shard_of_a);
    fr_test_error_has("tensor a has shape [2, 3], expected [3, 2]");
    assert_int_equal(fr_checkpoint_load_f32(c, "a", 1, sb, v), FR_EFORMAT); /* rank differs */
    assert_int_equal(fr_checkpoint_load_f32(c, "c", 1, (const int64_t[]){2}, v), FR_EUNSUPPORTED);
    fr_test_error_has("tensor c");
    fr_test_error_has("I32");
    assert_int_equal(fr_checkpoint_load_f32(c, "model.norm.weight", 1, sb, v), FR_EFORMAT);
    fr_test_error_has("missing tensor model.norm.weight");
    assert_int_equal(fr_checkpoint_load_f32(c, "a", 2, sa, NULL), FR_EINVAL);
    assert_int_equal(fr_checkpoint_load_f32(c, "a", 9, sa, v), FR_EINVAL);
}

static void test_single_file(void **state)
{
    (void)state;
    uint8_t d[40];
    data_ac(d);
    data_b(d + 24);
    write_text("config.json", CONFIG);
    write_st("model.safetensors",
             HDR_A "," HDR_C ",\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[24,40]}", d, 40);
    fr_checkpoint *c = open_ok();
    const fr_model_config *cfg = fr_checkpoint_config(c);
    assert_int_equal(cfg->hidden_size, 4);
    assert_int_equal(cfg->n_eos, 2);
    check_a_b_c(c, "model.safetensors");
    fr_checkpoint_close(&c);
    assert_null(c);
    fr_checkpoint_close(&c);
    fr_checkpoint_close(NULL);
}

static void test_sharded(void **state)
{
    (void)state;
    uint8_t ac[24], b[16];
    data_ac(ac);
    data_b(b);
    write_text("config.json", CONFIG);
    write_st("s-1.safetensors", HDR_A "," HDR_C, ac, 24);
    write_st("s-2.safetensors", HDR_B ",\"unlisted\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[16,16]}",
             b, 16);
    write_text("model.safetensors.index.json",
               "{\"metadata\":{\"total_size\":40},\"weight_map\":{\"a\":\"s-1.safetensors\","
               "\"b\":\"s-2.safetensors\",\"c\":\"s-1.safetensors\"}}");
    /* The index wins over a stray single file. */
    write_text("model.safetensors", "garbage");
    fr_checkpoint *c = open_ok();
    check_a_b_c(c, "s-1.safetensors");
    assert_null(fr_checkpoint_find(c, "unlisted")); /* only the weight_map counts */
    fr_checkpoint_close(&c);
}

static void expect_open_fails(fr_status want, const char *needle1, const char *needle2)
{
    fr_checkpoint *c = (fr_checkpoint *)1;
    fr_status rc = fr_checkpoint_open(tmpdir, &c);
    if (rc != want) fail_msg("got status %d (%s), want %d", rc, fr_last_error(), want);
    assert_null(c);
    if (needle1) fr_test_error_has(needle1);
    if (needle2) fr_test_error_has(needle2);
}

static void test_shard_defects(void **state)
{
    (void)state;
    uint8_t ac[24];
    data_ac(ac);
    write_text("config.json", CONFIG);
    write_st("s-1.safetensors", HDR_A "," HDR_C, ac, 24);

    /* Listed in the index, absent from its shard. */
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"s-1.safetensors\",\"ghost\":\"s-1.safetensors\"}}");
    expect_open_fails(FR_EFORMAT, "ghost", "s-1.safetensors");

    /* A shard that does not exist. */
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"s-1.safetensors\",\"b\":\"s-9.safetensors\"}}");
    expect_open_fails(FR_EIO, "s-9.safetensors", NULL);

    /* A corrupt shard: its own error, naming it. */
    write_file("s-3.safetensors", "\x02\0\0\0\0\0\0\0{", 9);
    write_text("model.safetensors.index.json", "{\"weight_map\":{\"a\":\"s-3.safetensors\"}}");
    expect_open_fails(FR_EFORMAT, "s-3.safetensors", NULL);

    /* Names that would leave the folder, and malformed indexes. */
    write_text("model.safetensors.index.json", "{\"weight_map\":{\"a\":\"../s-1.safetensors\"}}");
    expect_open_fails(FR_EFORMAT, "model.safetensors.index.json", "a");
    write_text("model.safetensors.index.json", "{\"weight_map\":{\"a\":1}}");
    expect_open_fails(FR_EFORMAT, "model.safetensors.index.json", NULL);
    write_text("model.safetensors.index.json", "{\"weight_map\":[]}");
    expect_open_fails(FR_EFORMAT, "weight_map", NULL);
    write_text("model.safetensors.index.json", "{\"weight_map\":");
    expect_open_fails(FR_EFORMAT, "model.safetensors.index.json", NULL);
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"a\":\"s-1.safetensors\",\"a\":\"s-1.safetensors\"}}");
    expect_open_fails(FR_EFORMAT, "twice", "a");
}

static void test_folder_defects(void **state)
{
    (void)state;
    /* No config. */
    expect_open_fails(FR_EIO, "config.json", NULL);
    /* A config but no weights. */
    write_text("config.json", CONFIG);
    expect_open_fails(FR_EIO, "model.safetensors", NULL);
    /* A bad config is reported before the weights are touched. */
    write_text("config.json", "{\"architectures\":[\"GPT2LMHeadModel\"]}");
    expect_open_fails(FR_EUNSUPPORTED, "GPT2LMHeadModel", "config.json");
    /* A truncated single file names itself and the tensor cut off. */
    uint8_t ac[24];
    data_ac(ac);
    write_text("config.json", CONFIG);
    write_st("model.safetensors", HDR_A "," HDR_C, ac, 20);
    expect_open_fails(FR_EFORMAT, "model.safetensors", "tensor c");

    fr_checkpoint *c = NULL;
    assert_int_equal(fr_checkpoint_open(NULL, &c), FR_EINVAL);
    assert_int_equal(fr_checkpoint_open(tmpdir, NULL), FR_EINVAL);
    assert_null(fr_checkpoint_find(NULL, "a"));
    assert_null(fr_checkpoint_config(NULL));
}

static float bf16_at(const fr_st_tensor *t, size_t i)
{
    const uint8_t *p = (const uint8_t *)t->data + 2 * i;
    uint32_t u = ((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_tq6(void **state)
{
    (void)state;
    const char *dir = fr_test_require_tq6();
    if (!dir) skip();
    fr_checkpoint *c = NULL;
    if (fr_checkpoint_open(dir, &c) != FR_OK) fail_msg("%s", fr_last_error());
    const fr_model_config *m = fr_checkpoint_config(c);
    assert_int_equal(m->num_layers, 6);
    assert_int_equal(m->hidden_size, 512);
    assert_int_equal(m->num_heads, 8);
    assert_int_equal(m->num_kv_heads, 2);
    assert_int_equal(m->head_dim, 128);
    assert_int_equal(m->intermediate_size, 1536);
    assert_int_equal(m->vocab_size, 272);
    assert_true(m->rope_theta == 1e6);
    assert_true(m->rms_norm_eps == 1e-6f);
    assert_int_equal(m->tie_word_embeddings, 0);
    assert_int_equal(m->bos_id, 256);
    assert_int_equal(m->n_eos, 1);
    assert_int_equal(m->eos_ids[0], 257);

    const int64_t emb_shape[2] = {272, 512}, down_shape[2] = {512, 1536}, wrong[2] = {1536, 512};
    float *emb = malloc(272 * 512 * sizeof *emb), *down = malloc(512 * 1536 * sizeof *down);
    assert_non_null(emb);
    assert_non_null(down);
    if (fr_checkpoint_load_f32(c, "model.embed_tokens.weight", 2, emb_shape, emb) != FR_OK)
        fail_msg("%s", fr_last_error());
    if (fr_checkpoint_load_f32(c, "model.layers.5.mlp.down_proj.weight", 2, down_shape, down) != FR_OK)
        fail_msg("%s", fr_last_error());
    /* Spot-check against the raw bf16 bytes, and that real weights arrived. */
    const fr_st_tensor *t = fr_checkpoint_find(c, "model.layers.5.mlp.down_proj.weight");
    assert_int_equal(t->dtype, FR_DTYPE_BF16);
    double sumsq = 0;
    for (size_t i = 0; i < 512 * 1536; i += 997) {
        assert_true(down[i] == bf16_at(t, i));
        assert_true(isfinite(down[i]));
        sumsq += (double)down[i] * down[i];
    }
    assert_true(sumsq > 0);
    assert_true(isfinite(emb[0]) && isfinite(emb[272 * 512 - 1]));

    assert_int_equal(fr_checkpoint_load_f32(c, "model.layers.5.mlp.down_proj.weight", 2, wrong, down),
                     FR_EFORMAT);
    fr_test_error_has("model-00004-of-00004.safetensors");
    fr_test_error_has("has shape [512, 1536], expected [1536, 512]");
    assert_non_null(fr_checkpoint_find(c, "lm_head.weight"));
    free(emb);
    free(down);
    fr_checkpoint_close(&c);
}

FR_TEST_MAIN(make_dir, remove_dir,
             cmocka_unit_test_setup(test_single_file, empty_dir),
             cmocka_unit_test_setup(test_sharded, empty_dir),
             cmocka_unit_test_setup(test_shard_defects, empty_dir),
             cmocka_unit_test_setup(test_folder_defects, empty_dir),
             cmocka_unit_test(test_tq6))
