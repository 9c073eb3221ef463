/* Weight updates on the wire (docs/protocol.md, update_weights) and the
 * server's path for them (trainer_bridge/server/update.h into the engine's
 * rules and stage, rollout/engine/weight_update.h): the update messages
 * and the new generate, done and stats keys round trip; malformed ones are
 * refused naming the problem; a whole synthetic:tiny:7 model sent in small
 * buckets stages bit-exactly, and each broken update (unknown tensor, wrong
 * shape, wrong dtype, bad checksum, NaN, bucket out of order, frames that
 * do not match the pieces, a missing tensor) fails with its error code. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include <zmq.h>

#include "rollout/engine/weight_update.h"
#include "rollout/model/model.h"
#include "rollout/model/tensor_table.h"
#include "trainer_bridge/client/client.h"
#include "trainer_bridge/client/client_internal.h"
#include "trainer_bridge/protocol/protocol.h"
#include "trainer_bridge/server/update.h"
#include "test_util.h"

static fr_msg_tensor tensor(const char *name, fr_dtype dt, int ndim, int64_t d0, int64_t d1)
{
    fr_msg_tensor t = {.dtype = dt, .ndim = ndim, .shape = {d0, d1}};
    snprintf(t.name, sizeof t.name, "%s", name);
    return t;
}

static void test_update_messages_round_trip(void **state)
{
    (void)state;
    fr_msg m, d;
    fr_msg_tensor ts[2] = {tensor("model.norm.weight", FR_DTYPE_F32, 1, 64, 0),
                           tensor("lm_head.weight", FR_DTYPE_BF16, 2, 272, 64)};
    fr_msg_init(&m, FR_MSG_UPDATE_BEGIN);
    m.u.update_begin = (fr_msg_update_begin){.version = 7, .tensors = ts, .n_tensors = 2,
                                             .total_bytes = 64 * 4 + 272 * 64 * 2, .bucket_bytes = 1 << 20};
    fr_test_round_trip(&m, &d, NULL);
    assert_true(d.u.update_begin.version == 7 && d.u.update_begin.n_tensors == 2 &&
                d.u.update_begin.bucket_bytes == 1 << 20);
    assert_int_equal(d.u.update_begin.partial, 0);   /* absent: a whole update */
    assert_memory_equal(d.u.update_begin.tensors, ts, sizeof ts);
    fr_msg_free(&d);
    m.u.update_begin.partial = 1;   /* "partial": true, beside "transport": "nccl" */
    m.u.update_begin.nccl = 1;
    fr_test_round_trip(&m, &d, NULL);
    assert_true(d.u.update_begin.partial == 1 && d.u.update_begin.nccl == 1);
    fr_msg_free(&d);

    fr_msg_piece ps[2] = {{.t = ts[0], .offset = 0, .nbytes = 256}, {.t = ts[1], .offset = 512, .nbytes = 1024}};
    fr_msg_init(&m, FR_MSG_UPDATE_BUCKET);
    m.u.update_bucket = (fr_msg_update_bucket){.version = 7, .bucket = 3, .xxh64 = UINT64_MAX, .pieces = ps,
                                               .n_pieces = 2};
    fr_test_round_trip(&m, &d, NULL);
    assert_true(d.u.update_bucket.bucket == 3 && d.u.update_bucket.xxh64 == UINT64_MAX &&
                d.u.update_bucket.n_pieces == 2);
    assert_memory_equal(d.u.update_bucket.pieces, ps, sizeof ps);
    fr_msg_free(&d);

    fr_msg_type ends[] = {FR_MSG_UPDATE_COMMIT, FR_MSG_UPDATE_ABORT};
    for (int i = 0; i < 2; i++) {
        fr_msg_init(&m, ends[i]);
        m.u.update_end.version = 1ull << 50;
        fr_test_round_trip(&m, &d, NULL);
        assert_true(d.u.update_end.version == 1ull << 50);
        assert_true(fr_msg_type_from_client(ends[i]));
    }
    assert_false(fr_msg_type_from_client(FR_MSG_UPDATE_REPLY));

    for (int stage = 0; stage < 4; stage++) {
        fr_msg_init(&m, FR_MSG_UPDATE_REPLY);
        m.u.update_reply = (fr_msg_update_reply){.version = 2, .stage = (fr_update_stage)stage,
                                                 .bucket = stage == FR_UPD_BUCKET ? 5 : -1, .bytes = 99,
                                                 .weight_version = 1};
        fr_test_round_trip(&m, &d, NULL);
        assert_memory_equal(&d.u.update_reply, &m.u.update_reply, sizeof m.u.update_reply);
    }
    const char *dt[] = {"f32", "bf16", "f16"};
    for (int i = 0; i < 3; i++) assert_string_equal(fr_dtype_name((fr_dtype)i), dt[i]);
    assert_int_equal(fr_msg_tensor_bytes(&ts[1]), 272 * 64 * 2);
}

static void test_new_generate_done_stats_keys(void **state)
{
    (void)state;
    int prompt[] = {256, 1}, forced[] = {5, 6, 7};
    fr_msg m, d;
    for (int mon = -1; mon <= 1; mon++) {
        fr_msg_init(&m, FR_MSG_GENERATE);
        m.u.generate.prompt = prompt;
        m.u.generate.n_prompt = 2;
        m.u.generate.monitor_divergence = mon;
        m.u.generate.per_token_kl = mon == 1;
        if (mon == 0) {
            m.u.generate.forced_tokens = forced;
            m.u.generate.n_forced_tokens = 3;
        }
        fr_test_round_trip(&m, &d, NULL);
        assert_int_equal(d.u.generate.monitor_divergence, mon);
        assert_int_equal(d.u.generate.per_token_kl, mon == 1);
        if (mon == 0) {
            assert_int_equal(d.u.generate.n_forced_tokens, 3);
            assert_memory_equal(d.u.generate.forced_tokens, forced, sizeof forced);
        } else {
            assert_null(d.u.generate.forced_tokens);
        }
        fr_msg_free(&d);
    }
    /* an empty forced_tokens is refused */
    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate.prompt = prompt;
    m.u.generate.n_prompt = 2;
    m.u.generate.forced_tokens = forced;
    m.u.generate.n_forced_tokens = 0;
    char *data;
    size_t len;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"forced_tokens\" must hold 1 to");

    float kl[3] = {0.0f, 1e-3f, 0.25f};
    fr_msg_init(&m, FR_MSG_DONE);
    m.u.done.total_ms = 2;
    m.u.done.n_tokens = 3;
    m.u.done.divergence = (fr_msg_divergence){.has_values = 1, .kl_mean = 0.1, .kl_max = 0.25,
                                              .top1_agreement = 1, .logprob_diff_mean = 0.01, .positions = 3,
                                              .kl = kl, .n_kl = 3};
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.done.divergence.n_kl, 3);
    assert_memory_equal(d.u.done.divergence.kl, kl, sizeof kl);
    fr_msg_free(&d);
    m.u.done.divergence.has_values = 0;   /* per-token KL without the summary: refused */
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("per_token_kl");

    fr_msg_init(&m, FR_MSG_STATS_REPLY);
    snprintf(m.u.stats_reply.state, sizeof m.u.stats_reply.state, "running");
    m.u.stats_reply.updating = 1;
    m.u.stats_reply.update_version = 4;
    m.u.stats_reply.updates_committed = 2;
    m.u.stats_reply.updates_failed = 5;
    fr_test_round_trip(&m, &d, NULL);
    assert_memory_equal(&d.u.stats_reply, &m.u.stats_reply, sizeof m.u.stats_reply);
}

static void expect_encode_refused(const fr_msg *m, const char *needle)
{
    char *data = NULL;
    size_t len;
    fr_status st = fr_msg_encode(m, &data, &len);
    if (st != FR_EFORMAT) fail_msg("encoded a bad %s (wanted: %s)", fr_msg_type_name(m->type), needle);
    fr_test_error_has(needle);
}

static void test_update_messages_refused(void **state)
{
    (void)state;
    fr_msg m;
    fr_msg_tensor ts[2] = {tensor("a", FR_DTYPE_F32, 1, 4, 0), tensor("a", FR_DTYPE_F32, 1, 4, 0)};
    fr_msg_init(&m, FR_MSG_UPDATE_BEGIN);
    m.u.update_begin = (fr_msg_update_begin){.version = 1, .tensors = ts, .n_tensors = 1, .total_bytes = 15,
                                             .bucket_bytes = 8};
    expect_encode_refused(&m, "\"total_bytes\" is 15 but the tensors listed hold 16 bytes");
    m.u.update_begin.total_bytes = 16;
    m.u.update_begin.bucket_bytes = 0;
    expect_encode_refused(&m, "\"bucket_bytes\" must be >= 1");
    m.u.update_begin.bucket_bytes = 8;
    ts[0].shape[0] = 0;
    expect_encode_refused(&m, "\"shape\"[0] must be >= 1");
    ts[0].shape[0] = 4;
    ts[0].ndim = 9;
    expect_encode_refused(&m, "1 to 8 dimensions");
    ts[0].ndim = 1;
    /* a name listed twice is refused when decoding */
    m.u.update_begin.n_tensors = 2;
    m.u.update_begin.total_bytes = 32;
    char *data;
    size_t len;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_OK);
    fr_msg d;
    assert_int_equal(fr_msg_decode(data, len, &d), FR_EFORMAT);
    fr_test_error_has("tensor \"a\" is listed twice");
    assert_int_equal(d.type, FR_MSG_NONE);
    free(data);

    fr_msg_piece p = {.t = tensor("b", FR_DTYPE_BF16, 2, 2, 3), .offset = 2, .nbytes = 12};
    fr_msg_init(&m, FR_MSG_UPDATE_BUCKET);
    m.u.update_bucket = (fr_msg_update_bucket){.version = 1, .bucket = 0, .pieces = &p, .n_pieces = 1};
    expect_encode_refused(&m, "bytes [2, 14) run past the tensor's 12 bytes");
    p.offset = 1;
    p.nbytes = 2;
    expect_encode_refused(&m, "must be multiples of the bf16 element size 2");
    m.u.update_bucket.n_pieces = 0;
    expect_encode_refused(&m, "\"pieces\" must hold at least one piece");

    fr_msg_init(&m, FR_MSG_UPDATE_REPLY);
    m.u.update_reply.stage = FR_UPD_BUCKET;
    expect_encode_refused(&m, "\"bucket\" is a number >= 0 exactly when");
}

/* Weights over NCCL on the wire: the group messages, the begin's transport
 * and the NCCL bucket round trip; malformed ones are refused. */
static void test_nccl_messages(void **state)
{
    (void)state;
    fr_msg m, d;
    fr_msg_init(&m, FR_MSG_NCCL_INIT);
    for (int i = 0; i < FR_PROTO_NCCL_ID_BYTES; i++) m.u.nccl_init.unique_id[i] = (unsigned char)(i * 7 + 3);
    fr_test_round_trip(&m, &d, NULL);
    assert_memory_equal(d.u.nccl_init.unique_id, m.u.nccl_init.unique_id, FR_PROTO_NCCL_ID_BYTES);
    fr_msg_free(&d);

    fr_msg_init(&m, FR_MSG_NCCL_CLOSE);
    fr_test_round_trip(&m, &d, NULL);
    fr_msg_free(&d);

    fr_msg_init(&m, FR_MSG_NCCL_REPLY);
    m.u.nccl_reply = (fr_msg_nccl_reply){.state = FR_NCCL_JOINING, .nranks = 2, .rank = 0, .timeout_s = 12.5};
    fr_test_round_trip(&m, &d, NULL);
    assert_true(d.u.nccl_reply.state == FR_NCCL_JOINING && d.u.nccl_reply.nranks == 2 && d.u.nccl_reply.rank == 0 &&
                d.u.nccl_reply.timeout_s == 12.5);
    char *json = NULL;
    assert_int_equal(fr_msg_to_json(&d, &json), FR_OK);
    assert_non_null(strstr(json, "\"state\":\"joining\""));
    free(json);
    fr_msg_free(&d);

    fr_msg_tensor ts[2] = {tensor("model.norm.weight", FR_DTYPE_F32, 1, 64, 0),
                           tensor("lm_head.weight", FR_DTYPE_BF16, 2, 272, 64)};
    fr_msg_init(&m, FR_MSG_UPDATE_BEGIN);
    m.u.update_begin = (fr_msg_update_begin){.version = 9, .tensors = ts, .n_tensors = 2,
                                             .total_bytes = 64 * 4 + 272 * 64 * 2, .bucket_bytes = 1 << 20, .nccl = 1};
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.update_begin.nccl, 1);
    fr_msg_free(&d);
    m.u.update_begin.nccl = 0;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.update_begin.nccl, 0);
    fr_msg_free(&d);

    fr_msg_piece ps[2] = {{.t = ts[0], .offset = 0, .nbytes = 256, .at = 0},
                          {.t = ts[1], .offset = 2048, .nbytes = 4096, .at = 512}};
    fr_msg_init(&m, FR_MSG_NCCL_BUCKET);
    m.u.nccl_bucket = (fr_msg_nccl_bucket){.version = 9, .bucket = 3, .nbytes = 4608, .checksum = 0xfedcba9876543210ull,
                                           .pieces = ps, .n_pieces = 2};
    fr_test_round_trip(&m, &d, NULL);
    assert_true(d.u.nccl_bucket.version == 9 && d.u.nccl_bucket.bucket == 3 && d.u.nccl_bucket.nbytes == 4608 &&
                d.u.nccl_bucket.checksum == 0xfedcba9876543210ull && d.u.nccl_bucket.n_pieces == 2);
    assert_memory_equal(d.u.nccl_bucket.pieces, ps, sizeof ps);
    fr_msg_free(&d);
    assert_true(fr_msg_type_from_client(FR_MSG_NCCL_INIT) && fr_msg_type_from_client(FR_MSG_NCCL_BUCKET) &&
                fr_msg_type_from_client(FR_MSG_NCCL_CLOSE) && !fr_msg_type_from_client(FR_MSG_NCCL_REPLY));

    /* refusals: a piece past the bucket, pieces out of order, misaligned "at", a bad reply */
    ps[1].at = 1024;
    expect_encode_refused(&m, "run past the bucket");
    ps[1].at = 128;
    expect_encode_refused(&m, "without overlapping");
    ps[1].at = 513;
    expect_encode_refused(&m, "element size");
    ps[1].at = 512;
    m.u.nccl_bucket.nbytes = 0;
    expect_encode_refused(&m, "\"nbytes\" must be >= 1");
    fr_msg_init(&m, FR_MSG_NCCL_REPLY);
    m.u.nccl_reply = (fr_msg_nccl_reply){.state = FR_NCCL_JOINING, .nranks = 1};
    expect_encode_refused(&m, "nranks");
}

/* Raw frames the decoder must refuse: a unique id of the wrong length or
 * type, an unknown transport, an NCCL bucket piece without "at". */
static void expect_decode_refused(const unsigned char *frame, size_t len, const char *needle)
{
    fr_msg d;
    if (fr_msg_decode(frame, len, &d) == FR_OK) fail_msg("decoded a frame that should be refused (%s)", needle);
    assert_int_equal(d.type, FR_MSG_NONE);
    fr_test_error_has(needle);
}

static size_t put_head(unsigned char *b, int n_keys, const char *type)
{
    size_t o = 0;
    b[o++] = (unsigned char)(0x80 | n_keys);
    b[o++] = 0xa4;
    memcpy(b + o, "type", 4);
    o += 4;
    b[o++] = (unsigned char)(0xa0 | strlen(type));
    memcpy(b + o, type, strlen(type));
    o += strlen(type);
    b[o++] = 0xa1;
    b[o++] = 'v';
    b[o++] = 1;
    return o;
}

static void test_nccl_messages_refused(void **state)
{
    (void)state;
    unsigned char b[512];
    size_t o = put_head(b, 3, "nccl_group_init");
    b[o++] = 0xa9;
    memcpy(b + o, "unique_id", 9);
    o += 9;
    b[o++] = 0xc4;
    b[o++] = 100;   /* 100 bytes, not 128 */
    memset(b + o, 1, 100);
    expect_decode_refused(b, o + 100, "unique_id");
    b[o - 2] = 0xc4;
    b[o - 1] = 128;
    memset(b + o, 1, 128);
    fr_msg d;
    assert_int_equal(fr_msg_decode(b, o + 128, &d), FR_OK);   /* the same frame with 128 bytes is fine */
    fr_msg_free(&d);
    o = put_head(b, 3, "nccl_group_init");
    b[o++] = 0xa9;
    memcpy(b + o, "unique_id", 9);
    o += 9;
    b[o++] = 0xa3;
    memcpy(b + o, "abc", 3);
    expect_decode_refused(b, o + 3, "unique_id");

    /* update_weights_begin with transport "tcp" */
    o = put_head(b, 7, "update_weights_begin");
    const char *rest[] = {"version", "total_bytes", "bucket_bytes"};
    for (int i = 0; i < 3; i++) {
        b[o++] = (unsigned char)(0xa0 | strlen(rest[i]));
        memcpy(b + o, rest[i], strlen(rest[i]));
        o += strlen(rest[i]);
        b[o++] = i == 1 ? 8 : 4;   /* total 8 bytes: two f32 */
    }
    b[o++] = 0xa7;
    memcpy(b + o, "tensors", 7);
    o += 7;
    b[o++] = 0x91;
    b[o++] = 0x83;
    b[o++] = 0xa4;
    memcpy(b + o, "name", 4);
    o += 4;
    b[o++] = 0xa1;
    b[o++] = 'x';
    b[o++] = 0xa5;
    memcpy(b + o, "dtype", 5);
    o += 5;
    b[o++] = 0xa3;
    memcpy(b + o, "f32", 3);
    o += 3;
    b[o++] = 0xa5;
    memcpy(b + o, "shape", 5);
    o += 5;
    b[o++] = 0x91;
    b[o++] = 2;
    b[o++] = 0xa9;
    memcpy(b + o, "transport", 9);
    o += 9;
    b[o++] = 0xa3;
    memcpy(b + o, "tcp", 3);
    expect_decode_refused(b, o + 3, "transport");
    memcpy(b + o - 1, "\xa4nccl", 5);
    assert_int_equal(fr_msg_decode(b, o + 4, &d), FR_OK);
    assert_int_equal(d.u.update_begin.nccl, 1);
    fr_msg_free(&d);
}

/* The client library refuses weights over NCCL without a usable device
 * before sending anything (no server listens here), and an update without
 * a group. */
static void test_client_nccl_without_device(void **state)
{
    (void)state;
    fr_client *c = NULL;
    assert_int_equal(fr_client_new("tcp://127.0.0.1:9", &c), FR_OK);
    fr_client_set_timeout(c, 500);
    assert_int_equal(fr_client_nccl_group_init(c, 1 << 20), FR_EUNSUPPORTED);
#ifdef FR_HAVE_CUDA
    fr_test_error_has("no CUDA device");
#else
    fr_test_error_has("built without CUDA");
#endif
    int64_t shape[1] = {4};
    float dev[4] = {0};
    fr_client_tensor t = {.name = "model.norm.weight", .dtype = FR_DTYPE_F32, .ndim = 1, .shape = shape, .data = dev};
    fr_status st = fr_client_update_weights_nccl(c, &t, 1, 2, NULL, NULL, NULL);
#ifdef FR_HAVE_CUDA
    assert_int_equal(st, FR_EINVAL);
    fr_test_error_has("needs an NCCL weight group");
#else
    assert_int_equal(st, FR_EUNSUPPORTED);
    fr_test_error_has("built without CUDA");
#endif
    assert_int_equal(fr_client_nccl_group_close(c), FR_OK);   /* nothing to close */
    assert_int_equal(fr_client_nccl_group_size(c), 0);
    fr_client_destroy(&c);
}

/* Sends message m from a ROUTER socket to the peer with routing id id. */
static void router_send(void *sock, const void *id, size_t id_len, const fr_msg *m)
{
    char *data = NULL;
    size_t len = 0;
    if (fr_msg_encode(m, &data, &len)) fail_msg("%s", fr_last_error());
    assert_true(zmq_send(sock, id, id_len, ZMQ_SNDMORE) >= 0);
    assert_true(zmq_send(sock, data, len, 0) >= 0);
    free(data);
}

/* After a refused pipelined update the server still answers the buckets
 * already sent (update_state once the update is gone). fr_client_settle_
 * reads those up to the reply of its own stats request, without taking any
 * for the client's last error, and keeps a request's results for their
 * reader; the next call then gets its own answer. A fake server (a ROUTER
 * socket) sends the stale answers ahead. */
static void test_client_settle_drops_stale_answers(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new(), *srv = zmq_socket(ctx, ZMQ_ROUTER);
    assert_non_null(srv);
    int linger = 0;
    zmq_setsockopt(srv, ZMQ_LINGER, &linger, sizeof linger);
    assert_int_equal(zmq_bind(srv, "tcp://127.0.0.1:*"), 0);
    char ep[256];
    size_t ep_len = sizeof ep;
    assert_int_equal(zmq_getsockopt(srv, ZMQ_LAST_ENDPOINT, ep, &ep_len), 0);
    fr_client *c = NULL;
    assert_int_equal(fr_client_new(ep, &c), FR_OK);
    fr_client_set_timeout(c, 5000);
    assert_int_equal(fr_client_send_raw(c, "x", 1, 0), FR_OK);   /* the server learns the client's id */
    unsigned char id[256];
    int id_len = zmq_recv(srv, id, sizeof id, 0);
    assert_true(id_len > 0);
    char junk[64];
    assert_true(zmq_recv(srv, junk, sizeof junk, 0) >= 0);
    fr_msg e, u, t, sr;
    fr_msg_init(&e, FR_MSG_ERROR);
    snprintf(e.u.error.code, sizeof e.u.error.code, "update_state");
    snprintf(e.u.error.message, sizeof e.u.error.message, "no weight update over NCCL of this client is in progress");
    fr_msg_init(&u, FR_MSG_UPDATE_REPLY);
    u.u.update_reply.version = 3;
    u.u.update_reply.stage = FR_UPD_BUCKET;
    u.u.update_reply.bucket = 4;
    fr_msg_init(&t, FR_MSG_ERROR);   /* an error naming a request: a result, kept */
    snprintf(t.u.error.code, sizeof t.u.error.code, "invalid_request");
    t.u.error.has_request_id = 1;
    t.u.error.request_id = 7;
    fr_msg_init(&sr, FR_MSG_STATS_REPLY);
    sr.u.stats_reply.weight_version = 2;
    snprintf(sr.u.stats_reply.state, sizeof sr.u.stats_reply.state, "running");
    router_send(srv, id, (size_t)id_len, &e);
    router_send(srv, id, (size_t)id_len, &u);
    router_send(srv, id, (size_t)id_len, &t);
    router_send(srv, id, (size_t)id_len, &e);
    router_send(srv, id, (size_t)id_len, &sr);   /* the reply to the settle's stats request */
    assert_int_equal(fr_client_settle_(c, 5000), FR_OK);
    const char *code = NULL, *msg = NULL;
    long long req = -1;
    assert_int_equal(fr_client_last_error(c, &code, &msg, &req), 0);   /* nothing taken for an error */
    sr.u.stats_reply.weight_version = 5;
    router_send(srv, id, (size_t)id_len, &sr);   /* the next call's own answer */
    fr_msg_stats_reply got;
    assert_int_equal(fr_client_stats(c, &got), FR_OK);
    assert_int_equal(got.weight_version, 5);
    fr_client_destroy(&c);
    zmq_close(srv);
    zmq_ctx_term(ctx);
}

/* ---- staging --------------------------------------------------------------- */

/* The model's tensors as a begin lists them (f32), and their data. */
typedef struct {
    fr_model *src;
    fr_msg_tensor *t;
    const float **data;
    int n;
    uint64_t total;
} source;

static void source_load(source *s, const char *spec)
{
    memset(s, 0, sizeof *s);
    assert_int_equal(fr_model_load(spec, &s->src), FR_OK);
    fr_weight_update *names;
    assert_int_equal(fr_weight_update_begin(&s->src->cfg, 0, &names), FR_OK);
    fr_model_tensor *mt;   /* the model's tensors, in the update's order */
    size_t n_mt;
    assert_int_equal(fr_model_tensor_list(&s->src->cfg, &s->src->w, &mt, &n_mt), FR_OK);
    s->n = fr_weight_update_tensor_count(names);
    assert_int_equal((size_t)s->n, n_mt);
    s->t = calloc((size_t)s->n, sizeof *s->t);
    s->data = calloc((size_t)s->n, sizeof *s->data);
    assert_non_null(s->t);
    assert_non_null(s->data);
    for (int i = 0; i < s->n; i++) {
        const char *name;
        int ndim;
        int64_t shape[2];
        assert_int_equal(fr_weight_update_tensor(names, i, &name, &ndim, shape), FR_OK);
        s->t[i] = tensor(name, FR_DTYPE_F32, ndim, shape[0], shape[1]);
        assert_string_equal(mt[i].name, name);
        s->data[i] = mt[i].data;
        assert_non_null(s->data[i]);
        s->total += fr_msg_tensor_bytes(&s->t[i]);
    }
    free(mt);
    fr_weight_update_free(&names);
}

static void source_free(source *s)
{
    fr_model_destroy(&s->src);
    free(s->t);
    free(s->data);
}

/* A bucket message with pieces [first, first + n) of the given tensors,
 * each a whole tensor, and its payload frames (copied into ZeroMQ messages
 * as the server would receive them). */
static void make_bucket(const source *s, const int *idx, int n, int bucket, fr_msg_update_bucket *b,
                        fr_msg_piece *pieces, fr_wire_msg *w)
{
    zmq_msg_t *frames = calloc((size_t)n, sizeof *frames);
    assert_non_null(frames);
    XXH64_state_t *h = XXH64_createState();
    XXH64_reset(h, 0);
    for (int k = 0; k < n; k++) {
        const fr_msg_tensor *t = &s->t[idx[k]];
        uint64_t nb = fr_msg_tensor_bytes(t);
        pieces[k] = (fr_msg_piece){.t = *t, .offset = 0, .nbytes = nb};
        zmq_msg_init_size(&frames[k], (size_t)nb);
        memcpy(zmq_msg_data(&frames[k]), s->data[idx[k]], (size_t)nb);
        XXH64_update(h, s->data[idx[k]], (size_t)nb);
    }
    *b = (fr_msg_update_bucket){.version = 2, .bucket = bucket, .xxh64 = XXH64_digest(h), .pieces = pieces,
                                .n_pieces = n};
    XXH64_freeState(h);
    memset(w, 0, sizeof *w);
    w->payload = frames;
    w->n_payload = n;
    w->n_frames = n + 1;
}

/* An update of the model's first n_tensors tensors, declared as the
 * server declares a begin. */
static fr_weight_update *begin_all(const source *s, int n_tensors)
{
    fr_msg_update_begin b = {.version = 2, .tensors = s->t, .n_tensors = n_tensors, .bucket_bytes = 1 << 20};
    for (int i = 0; i < n_tensors; i++) b.total_bytes += fr_msg_tensor_bytes(&s->t[i]);
    fr_weight_update *u = NULL;
    assert_int_equal(fr_weight_update_begin(&s->src->cfg, 0, &u), FR_OK);
    fr_weight_begin wb;
    fr_weight_refusal why;
    assert_int_equal(fr_bridge_begin_of(&b, &wb), FR_OK);
    if (fr_weight_update_declare(u, &wb, &why)) fail_msg("begin: %s (%s)", fr_last_error(), fr_weight_refusal_name(why));
    free(wb.tensors);
    return u;
}

/* A begin message the server's way; *code: the error code of a refusal. */
static fr_status declare(fr_weight_update *u, const fr_msg_update_begin *b, const char **code)
{
    fr_weight_begin wb;
    fr_weight_refusal why = FR_WREF_OUT_OF_MEMORY;
    fr_status st = fr_bridge_begin_of(b, &wb);
    if (!st) st = fr_weight_update_declare(u, &wb, &why);
    *code = fr_weight_refusal_name(why);
    free(wb.tensors);
    return st;
}

/* A bucket message the server's way: its frames, then the engine's rules
 * and stage. */
static fr_status stage_bucket(fr_weight_update *u, const fr_msg_update_bucket *b, const fr_wire_msg *w,
                              const char **code)
{
    fr_weight_bucket wb;
    uint64_t h = 0;
    fr_weight_refusal why = FR_WREF_BAD_BUCKET;
    fr_status st = fr_bridge_bucket_of(b, w, &wb, &h);
    if (!st) st = fr_weight_update_bucket(u, &wb, &h, &why);
    *code = fr_weight_refusal_name(why);
    free(wb.pieces);
    return st;
}

static void test_staging_whole_model(void **state)
{
    (void)state;
    source s;
    source_load(&s, "synthetic:tiny:7");
    fr_weight_update *u = begin_all(&s, s.n);
    const char *code;
    /* two tensors per bucket */
    fr_msg_piece pieces[2];
    for (int i = 0, k = 0; i < s.n; i += 2, k++) {
        int idx[2] = {i, i + 1};
        int n = i + 1 < s.n ? 2 : 1;
        fr_msg_update_bucket b;
        fr_wire_msg w;
        make_bucket(&s, idx, n, k, &b, pieces, &w);
        if (stage_bucket(u, &b, &w, &code)) fail_msg("bucket %d: %s", k, fr_last_error());
        fr_wire_msg_free(&w);
    }
    assert_int_equal(fr_weight_update_ready(u, NULL), FR_OK);
    assert_true(fr_weight_update_bytes(u) == s.total);
    /* the staged model is the source, bit for bit */
    size_t n_a = 0, n_b = 0;
    const float *a = fr_model_data(fr_weight_update_model(u), &n_a);
    const float *b = fr_model_data(s.src, &n_b);
    assert_true(n_a == n_b && n_a > 0);
    assert_memory_equal(a, b, n_a * sizeof(float));
    fr_weight_update_free(&u);
    assert_null(u);
    source_free(&s);
}

/* code: where the call under test stores its error code (read after it). */
static void expect_code(fr_status st, const char **code, const char *want, const char *needle)
{
    if (st == FR_OK) fail_msg("accepted (wanted %s)", want);
    assert_string_equal(*code, want);
    fr_test_error_has(needle);
}

static void test_staging_failures(void **state)
{
    (void)state;
    source s;
    source_load(&s, "synthetic:tiny:7");
    const char *code = NULL;

    /* begin: an unknown name, a wrong shape */
    fr_msg_tensor saved = s.t[1];
    snprintf(s.t[1].name, sizeof s.t[1].name, "model.layers.0.self_attn.x_proj.weight");
    fr_msg_update_begin b = {.version = 2, .tensors = s.t, .n_tensors = s.n, .total_bytes = s.total,
                             .bucket_bytes = 1 << 20};
    fr_weight_update *u = NULL;
    assert_int_equal(fr_weight_update_begin(&s.src->cfg, 0, &u), FR_OK);
    expect_code(declare(u, &b, &code), &code, "unknown_tensor", "x_proj");
    s.t[1] = saved;
    s.t[0].shape[0] += 1;
    expect_code(declare(u, &b, &code), &code, "bad_shape", "\"model.embed_tokens.weight\" has shape");
    s.t[0].shape[0] -= 1;
    fr_weight_update_free(&u);

    fr_msg_piece pieces[2];
    fr_msg_update_bucket bk;
    fr_wire_msg w;
    int idx0[1] = {0};

    /* a bad checksum */
    u = begin_all(&s, s.n);
    make_bucket(&s, idx0, 1, 0, &bk, pieces, &w);
    bk.xxh64 ^= 1;
    expect_code(stage_bucket(u, &bk, &w, &code), &code, "bad_checksum", "bucket 0: the checksum of the bytes received");
    fr_wire_msg_free(&w);
    fr_weight_update_free(&u);

    /* a NaN, named with its element */
    u = begin_all(&s, s.n);
    make_bucket(&s, idx0, 1, 0, &bk, pieces, &w);
    float nan = NAN;
    memcpy((char *)zmq_msg_data((zmq_msg_t *)w.payload) + 4 * 10, &nan, 4);
    XXH64_hash_t h = XXH64(zmq_msg_data((zmq_msg_t *)w.payload), (size_t)bk.pieces[0].nbytes, 0);
    bk.xxh64 = h;
    expect_code(stage_bucket(u, &bk, &w, &code), &code, "non_finite",
                "\"model.embed_tokens.weight\": element 10 is NaN");
    fr_wire_msg_free(&w);
    fr_weight_update_free(&u);

    /* out of order, frames that do not match, a dtype other than declared */
    u = begin_all(&s, s.n);
    make_bucket(&s, idx0, 1, 1, &bk, pieces, &w);
    expect_code(stage_bucket(u, &bk, &w, &code), &code, "update_state", "bucket 1 arrived, expected bucket 0");
    bk.bucket = 0;
    w.n_frames = 3;
    expect_code(stage_bucket(u, &bk, &w, &code), &code, "bad_bucket", "carries 2 payload frames");
    w.n_frames = 2;
    pieces[0].t.dtype = FR_DTYPE_F16;
    pieces[0].nbytes /= 2;
    expect_code(stage_bucket(u, &bk, &w, &code), &code, "bad_bucket", "its frame holds");
    fr_wire_msg_free(&w);
    fr_weight_update_free(&u);

    /* a tensor the model has but the begin left out: missing at commit */
    u = begin_all(&s, s.n - 1);
    for (int i = 0, k = 0; i < s.n - 1; i++, k++) {
        int idx[1] = {i};
        make_bucket(&s, idx, 1, k, &bk, pieces, &w);
        if (stage_bucket(u, &bk, &w, &code)) fail_msg("bucket %d: %s", k, fr_last_error());
        fr_wire_msg_free(&w);
    }
    fr_weight_refusal why;
    assert_int_not_equal(fr_weight_update_ready(u, &why), FR_OK);
    assert_string_equal(fr_weight_refusal_name(why), "missing_tensor");
    fr_test_error_has(s.t[s.n - 1].name);
    fr_weight_update_free(&u);
    source_free(&s);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_update_messages_round_trip),
             cmocka_unit_test(test_new_generate_done_stats_keys),
             cmocka_unit_test(test_update_messages_refused),
             cmocka_unit_test(test_nccl_messages),
             cmocka_unit_test(test_nccl_messages_refused),
             cmocka_unit_test(test_client_nccl_without_device),
             cmocka_unit_test(test_client_settle_drops_stale_answers),
             cmocka_unit_test(test_staging_whole_model),
             cmocka_unit_test(test_staging_failures))
