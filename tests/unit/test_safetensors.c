/* safetensors reader: dtype conversions, every header defect, mapped files. */
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
#include <unistd.h>

#include "base/safetensors.h"
#include "tests/unit/test_util.h"
#include "test_util.h"

#define LABEL "bad.safetensors"

/* A file image: 8-byte little-endian header length, header, data. */
static uint8_t *image(const char *header, const void *data, size_t data_len, size_t *len)
{
    size_t hl = strlen(header);
    *len = 8 + hl + data_len;
    uint8_t *b = malloc(*len);
    assert_non_null(b);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, header, hl);
    if (data_len) memcpy(b + 8 + hl, data, data_len);
    return b;
}

/* Parses header+data and expects failure `want` naming the label and, when
 * given, the tensor. */
static void expect_reject(const char *header, size_t data_len, fr_status want, const char *tensor)
{
    uint8_t data[256] = {0};
    assert_true(data_len <= sizeof data);
    size_t len;
    uint8_t *b = image(header, data, data_len, &len);
    fr_st_header *h = (fr_st_header *)1;
    fr_status rc = fr_st_parse_header(b, len, LABEL, &h);
    free(b);
    if (rc != want) fail_msg("header %s: got status %d (%s), want %d", header, rc, fr_last_error(), want);
    assert_null(h);
    fr_test_error_has(LABEL);
    if (tensor) fr_test_error_has(tensor);
}

static void test_dtype_table(void **state)
{
    (void)state;
    assert_int_equal(fr_dtype_size(FR_DTYPE_F32), 4);
    assert_int_equal(fr_dtype_size(FR_DTYPE_BF16), 2);
    assert_int_equal(fr_dtype_size(FR_DTYPE_F64), 8);
    assert_int_equal(fr_dtype_size(FR_DTYPE_BOOL), 1);
    assert_string_equal(fr_dtype_file_name(FR_DTYPE_I64), "I64");
    assert_string_equal(fr_dtype_file_name(FR_DTYPE_U8), "U8");
    assert_int_equal(fr_dtype_size((fr_dtype)99), 0);
    assert_string_equal(fr_dtype_file_name((fr_dtype)-1), "?");
}

static void test_parse_valid(void **state)
{
    (void)state;
    /* Entries deliberately out of name order, with metadata, a scalar and an
     * empty tensor, and space padding after the JSON as writers produce. */
    const char *hdr =
        "{\"zeta\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[8,16]},"
        "\"__metadata__\":{\"format\":\"pt\"},"
        "\"alpha\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[16,17]},"
        "\"empty\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[17,17]},"
        "\"mid\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[0,8]}}    ";
    uint8_t data[17];
    for (int i = 0; i < 17; i++) data[i] = (uint8_t)i;
    size_t len;
    uint8_t *b = image(hdr, data, sizeof data, &len);
    fr_st_header *h = NULL;
    assert_int_equal(fr_st_parse_header(b, len, "ok", &h), FR_OK);
    assert_int_equal(fr_st_header_count(h), 4);
    assert_string_equal(fr_st_header_tensor(h, 0)->name, "alpha");
    assert_string_equal(fr_st_header_tensor(h, 3)->name, "zeta");
    assert_null(fr_st_header_tensor(h, 4));
    assert_null(fr_st_header_tensor(h, -1));
    assert_null(fr_st_header_find(h, "__metadata__"));
    assert_null(fr_st_header_find(h, "nope"));

    const fr_st_tensor *t = fr_st_header_find(h, "zeta");
    assert_non_null(t);
    assert_int_equal(t->dtype, FR_DTYPE_I32);
    assert_int_equal(t->ndim, 1);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->nbytes, 8);
    assert_ptr_equal(t->data, b + len - 17 + 8);

    t = fr_st_header_find(h, "alpha");
    assert_int_equal(t->ndim, 0);
    assert_int_equal(fr_st_tensor_numel(t), 1);
    assert_int_equal(*(const uint8_t *)t->data, 16);

    t = fr_st_header_find(h, "empty");
    assert_int_equal(fr_st_tensor_numel(t), 0);
    assert_int_equal(fr_st_tensor_to_f32(t, NULL, 0), FR_OK);
    fr_st_header_free(&h);
    assert_null(h);
    fr_st_header_free(&h); /* idempotent */
    fr_st_header_free(NULL);
    free(b);

    /* An empty object is a valid file with no tensors. */
    b = image("{}", NULL, 0, &len);
    assert_int_equal(fr_st_parse_header(b, len, "ok", &h), FR_OK);
    assert_int_equal(fr_st_header_count(h), 0);
    assert_null(fr_st_header_find(h, "x"));
    fr_st_header_free(&h);
    free(b);
}

/* Wraps raw little-endian element bytes in a one-tensor image and converts. */
static fr_status convert(const char *dtype, const void *raw, size_t n, size_t esize, float *out)
{
    char hdr[200];
    snprintf(hdr, sizeof hdr, "{\"t.x\":{\"dtype\":\"%s\",\"shape\":[%zu],\"data_offsets\":[0,%zu]}}",
             dtype, n, n * esize);
    size_t len;
    uint8_t *b = image(hdr, raw, n * esize, &len);
    fr_st_header *h = NULL;
    assert_int_equal(fr_st_parse_header(b, len, "conv", &h), FR_OK);
    fr_status rc = fr_st_tensor_to_f32(fr_st_header_find(h, "t.x"), out, n);
    fr_st_header_free(&h);
    free(b);
    return rc;
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static void test_bf16(void **state)
{
    (void)state;
    /* bf16 -> f32 is a shift, so each result's bits are known exactly. */
    const uint16_t in[] = {0x3f80, 0xc020, 0x0000, 0x8000, 0x7f80, 0xff80,
                           0x7fc1, 0x0001, 0x8001, 0x7f7f, 0x3eab};
    const size_t n = sizeof in / sizeof in[0];
    uint8_t raw[2 * sizeof in / sizeof in[0]];
    for (size_t i = 0; i < n; i++) raw[2 * i] = (uint8_t)in[i], raw[2 * i + 1] = (uint8_t)(in[i] >> 8);
    float out[sizeof in / sizeof in[0]];
    assert_int_equal(convert("BF16", raw, n, 2, out), FR_OK);
    for (size_t i = 0; i < n; i++) assert_int_equal(bits(out[i]), (uint32_t)in[i] << 16);
    assert_true(out[0] == 1.0f && out[1] == -2.5f);
    assert_true(out[3] == 0.0f && signbit(out[3]));
    assert_true(isinf(out[4]) && out[4] > 0 && isinf(out[5]) && out[5] < 0);
    assert_true(isnan(out[6]));
    assert_true(out[7] == 0x1p-133f && out[8] == -0x1p-133f); /* bf16 subnormals */
}

/* An independent f16 decoding from the IEEE definition. */
static float f16_ref(uint16_t h)
{
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexpf((float)m, -24);
    else v = ldexpf((float)(1024 + m), e - 25);
    return s ? -v : v;
}

static void test_f16_exhaustive(void **state)
{
    (void)state;
    enum { N = 65536 };
    uint8_t *raw = malloc(2 * N);
    float *out = malloc(N * sizeof *out);
    assert_non_null(raw);
    assert_non_null(out);
    for (int i = 0; i < N; i++) raw[2 * i] = (uint8_t)i, raw[2 * i + 1] = (uint8_t)(i >> 8);
    assert_int_equal(convert("F16", raw, N, 2, out), FR_OK);
    for (int i = 0; i < N; i++) {
        float want = f16_ref((uint16_t)i);
        if (isnan(want)) {
            if (!isnan(out[i])) fail_msg("f16 0x%04x: want NaN, got %g", i, out[i]);
            /* The payload travels into the float32 mantissa. */
            assert_int_equal(bits(out[i]) & 0x7fffff, (uint32_t)(i & 1023) << 13);
        } else if (bits(out[i]) != bits(want)) {
            fail_msg("f16 0x%04x: got %a, want %a", i, out[i], want);
        }
    }
    /* Spot checks that read as the cases the format is known for. */
    assert_true(out[0x3c00] == 1.0f);
    assert_true(out[0x7bff] == 65504.0f);
    assert_true(out[0x0001] == 0x1p-24f);   /* smallest subnormal */
    assert_true(out[0x03ff] == 0x1.ff8p-15f); /* largest subnormal */
    assert_true(out[0x0400] == 0x1p-14f);   /* smallest normal */
    assert_true(out[0x8000] == 0.0f && signbit(out[0x8000]));
    assert_true(isinf(out[0x7c00]) && isinf(out[0xfc00]) && out[0xfc00] < 0);
    free(raw);
    free(out);
}

static void test_f32_and_unsupported(void **state)
{
    (void)state;
    fr_test_rng rng = {42};
    enum { N = 257 };
    float in[N], out[N];
    for (int i = 0; i < N; i++) in[i] = fr_test_normal(&rng) * 1e3f;
    in[0] = -0.0f, in[1] = INFINITY, in[2] = 0x1p-149f;
    uint8_t raw[4 * N];
    for (int i = 0; i < N; i++)
        for (int k = 0; k < 4; k++) raw[4 * i + k] = (uint8_t)(bits(in[i]) >> (8 * k));
    assert_int_equal(convert("F32", raw, N, 4, out), FR_OK);
    for (int i = 0; i < N; i++) assert_int_equal(bits(out[i]), bits(in[i]));

    /* Integer dtypes are not silently reinterpreted. */
    assert_int_equal(convert("I32", raw, 4, 4, out), FR_EUNSUPPORTED);
    fr_test_error_has("t.x");
    fr_test_error_has("I32");
    assert_int_equal(convert("F64", raw, 4, 8, out), FR_EUNSUPPORTED);

    /* A wrong element count is a caller bug, reported with the name. */
    fr_st_tensor t = {.name = "t.count", .dtype = FR_DTYPE_F32, .ndim = 1, .shape = {4}, .nbytes = 16, .data = raw};
    assert_int_equal(fr_st_tensor_to_f32(&t, out, 5), FR_EINVAL);
    fr_test_error_has("t.count");
    assert_int_equal(fr_st_tensor_to_f32(&t, NULL, 4), FR_EINVAL);
    assert_int_equal(fr_st_tensor_to_f32(NULL, out, 4), FR_EINVAL);
}

static void test_reject_framing(void **state)
{
    (void)state;
    fr_st_header *h = (fr_st_header *)1;
    const uint8_t small[3] = {1, 0, 0};
    assert_int_equal(fr_st_parse_header(small, sizeof small, LABEL, &h), FR_EFORMAT);
    assert_null(h);
    fr_test_error_has(LABEL);
    fr_test_error_has("truncated");

    /* Header length past the end, and one so large that len + 8 would wrap. */
    size_t len;
    uint8_t *b = image("{}", NULL, 0, &len);
    b[0] = 200;
    assert_int_equal(fr_st_parse_header(b, len, LABEL, &h), FR_EFORMAT);
    fr_test_error_has(LABEL);
    fr_test_error_has("header length 200");
    memset(b, 0xff, 8);
    assert_int_equal(fr_st_parse_header(b, len, LABEL, &h), FR_EFORMAT);
    fr_test_error_has(LABEL);
    fr_test_error_has("limit");
    memset(b, 0, 8);
    assert_int_equal(fr_st_parse_header(b, len, LABEL, &h), FR_EFORMAT); /* empty header */
    fr_test_error_has(LABEL);
    free(b);

    assert_int_equal(fr_st_parse_header(NULL, 0, LABEL, &h), FR_EFORMAT);
    assert_int_equal(fr_st_parse_header(NULL, 10, LABEL, &h), FR_EINVAL);
    assert_int_equal(fr_st_parse_header(small, 3, LABEL, NULL), FR_EINVAL);

    expect_reject("{\"w.bad\": {\"dtype\":", 0, FR_EFORMAT, NULL); /* malformed JSON */
    expect_reject("[1, 2]", 0, FR_EFORMAT, NULL);                  /* not an object */
    expect_reject("{} junk", 0, FR_EFORMAT, NULL);                 /* trailing bytes */

    /* A NUL inside the header must not end it early: C strings would. */
    const uint8_t nul[] = {5, 0, 0, 0, 0, 0, 0, 0, '{', '}', 0, ' ', ' '};
    assert_int_equal(fr_st_parse_header(nul, sizeof nul, LABEL, &h), FR_EFORMAT);
    fr_test_error_has(LABEL);
}

static void test_reject_entries(void **state)
{
    (void)state;
#define ENTRY(body) "{\"ok\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"w.bad\":" body "}"
    /* Offsets out of the data region, reversed, or malformed. */
    expect_reject(ENTRY("{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[1,17]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[9,8]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,\"1\"]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[1]}"), 16, FR_EFORMAT, "w.bad");
    /* Size mismatch: 2x3 F32 needs 24 bytes, the offsets give 16. */
    expect_reject(ENTRY("{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,16]}"), 32, FR_EFORMAT, "w.bad");
    /* Dtype problems. */
    expect_reject(ENTRY("{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,1]}"), 16, FR_EFORMAT, "w.bad");
    fr_test_error_has("Q4");
    expect_reject(ENTRY("{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"shape\":[1],\"data_offsets\":[0,4]}"), 16, FR_EFORMAT, "w.bad");
    /* Shape problems. */
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":\"1\",\"data_offsets\":[0,1]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}"), 16,
                  FR_EUNSUPPORTED, "w.bad");
    /* 2^32 * 2^32 * 4 wraps a 64-bit product to 0, which would match [0,0]. */
    expect_reject(ENTRY("{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}"), 16,
                  FR_EFORMAT, "w.bad");
    fr_test_error_has("overflow");
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[1e300],\"data_offsets\":[0,1]}"), 16, FR_EFORMAT, "w.bad");
    expect_reject(ENTRY("7"), 16, FR_EFORMAT, "w.bad");
    /* Duplicate names (JSON allows them syntactically). */
    expect_reject(ENTRY("{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]},"
                        "\"w.bad\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}"),
                  16, FR_EFORMAT, "w.bad");
    fr_test_error_has("duplicate");
#undef ENTRY
}

/* Random byte mutations of a valid image must fail cleanly or parse to
 * tensors that stay inside the buffer; valgrind checks the rest. */
static void test_mutations(void **state)
{
    (void)state;
    const char *hdr = "{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
                      "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}";
    uint8_t data[16] = {0};
    size_t len;
    uint8_t *orig = image(hdr, data, sizeof data, &len);
    uint8_t *b = malloc(len);
    assert_non_null(b);
    fr_test_rng rng = {7};
    for (int it = 0; it < 3000; it++) {
        memcpy(b, orig, len);
        int nmut = 1 + (int)(fr_test_u64(&rng) % 4);
        for (int k = 0; k < nmut; k++) b[fr_test_u64(&rng) % len] = (uint8_t)fr_test_u64(&rng);
        size_t cut = it % 5 == 0 ? (size_t)(fr_test_u64(&rng) % len) : len;
        fr_st_header *h = NULL;
        if (fr_st_parse_header(b, cut, "mut", &h) == FR_OK) {
            for (int i = 0; i < fr_st_header_count(h); i++) {
                const fr_st_tensor *t = fr_st_header_tensor(h, i);
                assert_true((const uint8_t *)t->data >= b && (const uint8_t *)t->data + t->nbytes <= b + cut);
            }
            fr_st_header_free(&h);
        } else {
            assert_null(h);
            fr_test_error_has("mut");
        }
    }
    free(b);
    free(orig);
}

/* ---- files ----------------------------------------------------------------- */

static char tmpdir[] = "/tmp/fr_st_XXXXXX";

static int make_dir(void **state)
{
    (void)state;
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int remove_dir(void **state)
{
    (void)state;
    fr_test_clear_dir(tmpdir, 0);
    return rmdir(tmpdir);
}

static const char *write_file(const char *name, const void *buf, size_t len)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(buf, 1, len, fp), len);
    fclose(fp);
    return path;
}

static void test_file_open(void **state)
{
    (void)state;
    const char *hdr = "{\"w.one\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]},"
                      "\"w.two\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}";
    const uint8_t data[8] = {0x80, 0x3f, 0x00, 0xc0, 0x00, 0x00, 0x80, 0xbf}; /* 1, -2 | -1 */
    size_t len;
    uint8_t *b = image(hdr, data, sizeof data, &len);

    const char *path = write_file("good.safetensors", b, len);
    fr_st_file *f = NULL;
    assert_int_equal(fr_st_file_open(path, &f), FR_OK);
    assert_string_equal(fr_st_file_path(f), path);
    assert_int_equal(fr_st_file_count(f), 2);
    assert_string_equal(fr_st_file_tensor(f, 1)->name, "w.two");
    assert_null(fr_st_file_tensor(f, 2));
    float v[2];
    assert_int_equal(fr_st_tensor_to_f32(fr_st_file_find(f, "w.one"), v, 2), FR_OK);
    assert_true(v[0] == 1.0f && v[1] == -2.0f);
    assert_int_equal(fr_st_tensor_to_f32(fr_st_file_find(f, "w.two"), v, 1), FR_OK);
    assert_true(v[0] == -1.0f);
    assert_null(fr_st_file_find(f, "w.three"));
    fr_st_file_close(&f);
    assert_null(f);
    fr_st_file_close(&f);
    fr_st_file_close(NULL);

    /* Truncated: the data region ends before w.two's bytes. */
    path = write_file("trunc.safetensors", b, len - 3);
    assert_int_equal(fr_st_file_open(path, &f), FR_EFORMAT);
    assert_null(f);
    fr_test_error_has(path);
    fr_test_error_has("w.two");

    /* Truncated inside the length prefix, and empty. */
    path = write_file("tiny.safetensors", b, 5);
    assert_int_equal(fr_st_file_open(path, &f), FR_EFORMAT);
    fr_test_error_has(path);
    path = write_file("empty.safetensors", b, 0);
    assert_int_equal(fr_st_file_open(path, &f), FR_EFORMAT);
    fr_test_error_has(path);
    fr_test_error_has("truncated");
    free(b);

    /* Malformed header. */
    b = image("{\"w.one\": nonsense}", NULL, 0, &len);
    path = write_file("json.safetensors", b, len);
    assert_int_equal(fr_st_file_open(path, &f), FR_EFORMAT);
    fr_test_error_has(path);
    free(b);

    /* Missing, and not a regular file. */
    char missing[512];
    snprintf(missing, sizeof missing, "%s/none.safetensors", tmpdir);
    assert_int_equal(fr_st_file_open(missing, &f), FR_EIO);
    fr_test_error_has(missing);
    assert_int_equal(fr_st_file_open(tmpdir, &f), FR_EIO);
    fr_test_error_has(tmpdir);
    assert_int_equal(fr_st_file_open(NULL, &f), FR_EINVAL);
    assert_int_equal(fr_st_file_open(missing, NULL), FR_EINVAL);
}

static void test_golden(void **state)
{
    (void)state;
    const char *dir = fr_test_require_tq6();
    if (!dir) skip();
    char path[1024];
    snprintf(path, sizeof path, "%s/golden.safetensors", dir);
    fr_st_file *f = NULL;
    if (fr_st_file_open(path, &f) != FR_OK) fail_msg("%s", fr_last_error());
    const fr_st_tensor *t = fr_st_file_find(f, "p1.ids");
    assert_non_null(t);
    assert_int_equal(t->dtype, FR_DTYPE_I32);
    assert_int_equal(t->ndim, 1);
    assert_int_equal(t->shape[0], 9);
    const uint8_t *p = t->data;
    int32_t first = (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
    assert_int_equal(first, 256); /* BOS */
    t = fr_st_file_find(f, "p5.logits_f32");
    assert_non_null(t);
    assert_int_equal(t->shape[0], 4096);
    assert_int_equal(t->shape[1], 272);
    fr_st_file_close(&f);
}

FR_TEST_MAIN(make_dir, remove_dir,
             cmocka_unit_test(test_dtype_table),
             cmocka_unit_test(test_parse_valid),
             cmocka_unit_test(test_bf16),
             cmocka_unit_test(test_f16_exhaustive),
             cmocka_unit_test(test_f32_and_unsupported),
             cmocka_unit_test(test_reject_framing),
             cmocka_unit_test(test_reject_entries),
             cmocka_unit_test(test_mutations),
             cmocka_unit_test(test_file_open),
             cmocka_unit_test(test_golden))
