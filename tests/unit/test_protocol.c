/* The trainer bridge's protocol codec (trainer_bridge/protocol/protocol.h): every
 * message type encoded and decoded back field by field, and every way a
 * frame can be refused (not msgpack, not a map, type and version, missing,
 * unknown, repeated and mistyped keys, values out of range), each with a
 * message naming the problem; and the reading of a socket monitor's events
 * (wire.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "trainer_bridge/protocol/protocol.h"
#include "protocol_samples.h"
#include "test_util.h"
#include "trainer_bridge/protocol/wire.h"

static void test_hello_and_empty_messages(void **state)
{
    (void)state;
    fr_msg m, d;
    fr_msg_init(&m, FR_MSG_HELLO);
    fr_test_round_trip(&m, &d, NULL);
    assert_string_equal(d.u.hello.client, "");
    fr_msg_free(&d);
    snprintf(m.u.hello.client, sizeof m.u.hello.client, "trainer-7");
    fr_test_round_trip(&m, &d, NULL);
    assert_string_equal(d.u.hello.client, "trainer-7");
    fr_msg_free(&d);
    fr_msg_type empty[] = {FR_MSG_RESUME, FR_MSG_STATS};
    for (int i = 0; i < 2; i++) {
        fr_msg_init(&m, empty[i]);
        fr_test_round_trip(&m, &d, NULL);
        fr_msg_free(&d);
    }
    fr_msg_init(&m, FR_MSG_PAUSE);
    m.u.pause.mode = FR_PAUSE_WAIT;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.pause.mode, FR_PAUSE_WAIT);
    m.u.pause.mode = FR_PAUSE_ABORT;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.pause.mode, FR_PAUSE_ABORT);
    fr_msg_init(&m, FR_MSG_RESUME_REPLY);
    m.u.resume_reply.released = 3;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.resume_reply.released, 3);
    fr_msg_init(&m, FR_MSG_PAUSE_REPLY);
    m.u.pause_reply.mode = FR_PAUSE_WAIT;
    m.u.pause_reply.aborted = 5;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.pause_reply.mode, FR_PAUSE_WAIT);
    assert_int_equal(d.u.pause_reply.aborted, 5);
}

static void test_generate_full_and_minimal(void **state)
{
    (void)state;
    int prompt[] = {256, 0, 7, 271}, stop[] = {257, 3};
    fr_msg m, d;
    fr_msg_init(&m, FR_MSG_GENERATE);
    fr_msg_generate *g = &m.u.generate;
    g->request_id = UINT64_MAX;
    g->prompt = prompt;
    g->n_prompt = 4;
    g->n = 4;
    g->has_group_id = 1;
    g->group_id = 1ull << 40;
    g->has_temperature = 1;
    g->temperature = 0.7;
    g->has_top_k = 1;
    g->top_k = 50;
    g->has_top_p = 1;
    g->top_p = 0.95;
    g->has_max_tokens = 1;
    g->max_tokens = 300;
    g->has_stop_token_ids = 1;
    g->stop_token_ids = stop;
    g->n_stop_token_ids = 2;
    g->has_seed = 1;
    g->seed = 12345678901234ull;
    g->first_sample = 3;
    g->min_tokens = 7;
    g->logprobs = 20;
    g->prompt_logprobs = 1;
    g->monitor_divergence = 1;
    fr_test_round_trip(&m, &d, NULL);
    const fr_msg_generate *h = &d.u.generate;
    assert_true(h->request_id == UINT64_MAX);
    assert_int_equal(h->n_prompt, 4);
    assert_memory_equal(h->prompt, prompt, sizeof prompt);
    assert_int_equal(h->n, 4);
    assert_true(h->has_group_id && h->group_id == 1ull << 40);
    assert_true(h->has_temperature && h->temperature == 0.7);
    assert_true(h->has_top_k && h->top_k == 50);
    assert_true(h->has_top_p && h->top_p == 0.95);
    assert_true(h->has_max_tokens && h->max_tokens == 300);
    assert_true(h->has_stop_token_ids && h->n_stop_token_ids == 2);
    assert_memory_equal(h->stop_token_ids, stop, sizeof stop);
    assert_true(h->has_seed && h->seed == 12345678901234ull);
    assert_int_equal(h->first_sample, 3);
    assert_true(h->min_tokens == 7 && h->logprobs == 20 && h->prompt_logprobs == 1);
    assert_int_equal(h->monitor_divergence, 1);
    fr_msg_free(&d);
    assert_int_equal(d.type, FR_MSG_NONE);

    /* Only the required keys: every optional one reads as absent. An empty
     * stop list is present (no stop ids), not absent. */
    fr_msg_init(&m, FR_MSG_GENERATE);
    g->request_id = 0;
    g->prompt = prompt;
    g->n_prompt = 1;
    g->has_stop_token_ids = 1;
    g->n_stop_token_ids = 0;
    g->stop_token_ids = NULL;
    fr_test_round_trip(&m, &d, NULL);
    h = &d.u.generate;
    assert_int_equal(h->n, 1);
    assert_false(h->has_group_id || h->has_temperature || h->has_top_k || h->has_top_p || h->has_max_tokens ||
                 h->has_seed || h->first_sample || h->monitor_divergence != -1 || h->per_token_kl ||
                 h->forced_tokens || h->min_tokens || h->logprobs || h->prompt_logprobs);
    assert_true(h->has_stop_token_ids);
    assert_int_equal(h->n_stop_token_ids, 0);
    fr_msg_free(&d);
}

static void test_abort(void **state)
{
    (void)state;
    uint64_t ids[] = {1, 99, UINT64_MAX};
    fr_msg m, d;
    fr_msg_init(&m, FR_MSG_ABORT);
    m.u.abort.request_ids = ids;
    m.u.abort.n_request_ids = 3;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.abort.all, 0);
    assert_int_equal(d.u.abort.n_request_ids, 3);
    assert_memory_equal(d.u.abort.request_ids, ids, sizeof ids);
    fr_msg_free(&d);
    fr_msg_init(&m, FR_MSG_ABORT);
    m.u.abort.all = 1;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.abort.all, 1);
    assert_int_equal(d.u.abort.n_request_ids, 0);
    fr_msg_free(&d);
    fr_msg_init(&m, FR_MSG_ABORT_REPLY);
    m.u.abort_reply.samples = 8;
    m.u.abort_reply.not_found = ids;
    m.u.abort_reply.n_not_found = 2;
    fr_test_round_trip(&m, &d, NULL);
    assert_int_equal(d.u.abort_reply.samples, 8);
    assert_int_equal(d.u.abort_reply.n_not_found, 2);
    assert_true(d.u.abort_reply.not_found[1] == 99);
    fr_msg_free(&d);
}

static void test_hello_reply(void **state)
{
    (void)state;
    fr_msg m, d;
    fr_sample_hello_reply(&m);
    const fr_msg_hello_reply *h = &m.u.hello_reply;
    fr_test_round_trip(&m, &d, NULL);
    assert_memory_equal(&d.u.hello_reply, h, sizeof *h);
}

static void test_tokens(void **state)
{
    (void)state;
    fr_msg m, d;
    fr_sample_tokens(&m);
    const fr_msg_tokens *k = &m.u.tokens;
    fr_test_round_trip(&m, &d, NULL);
    assert_true(d.u.tokens.request_id == k->request_id);
    assert_int_equal(d.u.tokens.sample, k->sample);
    assert_int_equal(d.u.tokens.start, k->start);
    assert_int_equal(d.u.tokens.n, k->n);
    assert_memory_equal(d.u.tokens.token_ids, k->token_ids, sizeof(int) * 3);
    assert_memory_equal(d.u.tokens.logprobs, k->logprobs, sizeof(float) * 3);   /* float32 on the wire: exact */
    assert_memory_equal(d.u.tokens.weight_versions, k->weight_versions, sizeof(uint64_t) * 3);
    fr_msg_free(&d);
}

static void test_done(void **state)
{
    (void)state;
    fr_msg m, d;
    for (int variant = 0; variant < 2; variant++) {
        fr_msg_init(&m, FR_MSG_DONE);
        fr_msg_done *x = &m.u.done;
        x->request_id = 9;
        x->group_id = 2;
        x->sample = 1;
        x->finish_reason = variant ? FR_WIRE_ABORT : FR_WIRE_LENGTH;
        x->n_tokens = variant ? 0 : 40;
        x->n_prompt = 12;
        x->preemptions = 2;
        x->has_ttft = !variant;
        x->ttft_ms = variant ? 0 : 3.5;
        x->total_ms = 250.25;
        /* the seed is optional on the wire (a server that predates it sends none);
         * the full 64 bits must survive */
        x->has_seed = !variant;
        x->seed = variant ? 0 : 0xFEDCBA9876543210ull;
        /* top and prompt log-probs, when asked for */
        static int top_ids[40 * 3];
        static float top_lps[40 * 3], plp[11];
        for (int i = 0; i < 120; i++) {
            top_ids[i] = i % 272;
            top_lps[i] = -0.125f * (float)i;
        }
        for (int i = 0; i < 11; i++) plp[i] = -1.0f / (float)(i + 1);
        if (!variant) {
            x->top_k = 3;
            x->top_token_ids = top_ids;
            x->top_logprobs = top_lps;
            x->prompt_logprobs = plp;
            x->n_prompt_logprobs = 11;
        }
        if (variant) {   /* a monitored sample's figures travel as numbers */
            x->divergence = (fr_msg_divergence){.has_values = 1, .kl_mean = 1e-3, .kl_max = 0.02,
                                                .top1_agreement = 0.98, .logprob_diff_mean = -0.01, .positions = 40};
        }
        fr_test_round_trip(&m, &d, NULL);
        const fr_msg_done *y = &d.u.done;
        assert_true(y->request_id == 9 && y->group_id == 2);
        assert_int_equal(y->sample, 1);
        assert_int_equal(y->finish_reason, x->finish_reason);
        assert_int_equal(y->n_tokens, x->n_tokens);
        assert_int_equal(y->n_prompt, 12);
        assert_int_equal(y->preemptions, 2);
        assert_int_equal(y->has_ttft, x->has_ttft);
        assert_true(y->ttft_ms == x->ttft_ms && y->total_ms == 250.25);
        assert_int_equal(y->divergence.has_values, variant);
        assert_int_equal(y->has_seed, !variant);
        assert_true(y->seed == x->seed);
        assert_int_equal(y->top_k, variant ? 0 : 3);
        assert_int_equal(y->n_prompt_logprobs, variant ? 0 : 11);
        if (!variant) {
            assert_memory_equal(y->top_token_ids, top_ids, sizeof top_ids);
            assert_memory_equal(y->top_logprobs, top_lps, sizeof top_lps);
            assert_memory_equal(y->prompt_logprobs, plp, sizeof plp);
        } else {
            assert_null(y->top_token_ids);
            assert_null(y->prompt_logprobs);
        }
        if (variant)
            assert_true(y->divergence.kl_mean == 1e-3 && y->divergence.kl_max == 0.02 &&
                        y->divergence.top1_agreement == 0.98 && y->divergence.logprob_diff_mean == -0.01 &&
                        y->divergence.positions == 40);
        fr_msg_free(&d);
    }
    const char *names[] = {"stop", "length", "abort", "error"};
    for (int f = 0; f < 4; f++) assert_string_equal(fr_wire_finish_name((fr_wire_finish)f), names[f]);
}

static void test_stats_reply_and_error(void **state)
{
    (void)state;
    fr_msg m, d;
    fr_msg_init(&m, FR_MSG_STATS_REPLY);
    fr_msg_stats_reply *s = &m.u.stats_reply;
    s->running = 1;
    s->prefilling = 2;
    s->waiting = 3;
    s->preemptions = 4;
    s->tokens_generated = 5;
    s->prefill_tokens = 6;
    s->steps = 7;
    s->finished = 8;
    s->kv_blocks_used = 9;
    s->kv_blocks_free = 10;
    snprintf(s->state, sizeof s->state, "pausing");
    s->weight_version = 11;
    s->clients = 12;
    s->open_requests = 13;
    s->held_requests = 14;
    s->messages_in = 15;
    s->messages_out = 16;
    s->bad_messages = 17;
    s->errors_sent = 18;
    s->requests_accepted = 19;
    s->requests_rejected = 20;
    s->samples_done = 21;
    s->tokens_streamed = 22;
    s->send_retries = 23;
    s->queued_messages = 24;
    s->undeliverable_messages = 25;
    fr_test_round_trip(&m, &d, NULL);
    assert_memory_equal(&d.u.stats_reply, s, sizeof *s);

    fr_msg_init(&m, FR_MSG_ERROR);
    snprintf(m.u.error.code, sizeof m.u.error.code, "invalid_request");
    snprintf(m.u.error.message, sizeof m.u.error.message, "generate: \"top_p\" must be in (0, 1]");
    fr_test_round_trip(&m, &d, NULL);
    assert_string_equal(d.u.error.code, "invalid_request");
    assert_string_equal(d.u.error.message, m.u.error.message);
    assert_int_equal(d.u.error.has_request_id, 0);
    m.u.error.has_request_id = 1;
    m.u.error.request_id = 77;
    fr_test_round_trip(&m, &d, NULL);
    assert_true(d.u.error.has_request_id && d.u.error.request_id == 77);
}

static void test_encode_refuses_invalid(void **state)
{
    (void)state;
    char *data = (char *)1;
    size_t len = 1;
    fr_msg m;
    fr_msg_init(&m, FR_MSG_GENERATE);   /* no prompt */
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    assert_null(data);
    fr_test_error_has("\"prompt\" must hold 1");
    int p[] = {1};
    m.u.generate.prompt = p;
    m.u.generate.n_prompt = 1;
    m.u.generate.has_top_p = 1;
    m.u.generate.top_p = 0;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("top_p");
    fr_msg_init(&m, FR_MSG_ABORT);
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("at least one id");
    fr_msg_init(&m, FR_MSG_ERROR);
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    fr_test_error_has("\"code\" is empty");
    fr_msg_init(&m, FR_MSG_NONE);
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_EFORMAT);
    assert_int_equal(fr_msg_encode(NULL, &data, &len), FR_EINVAL);
    assert_int_equal(fr_msg_encode(&m, NULL, &len), FR_EINVAL);
    assert_int_equal(fr_msg_decode("x", 1, NULL), FR_EINVAL);
    assert_string_equal(fr_msg_type_name((fr_msg_type)99), "none");
    assert_true(fr_msg_type_from_client(FR_MSG_GENERATE));
    assert_false(fr_msg_type_from_client(FR_MSG_TOKENS));
}

/* ---- hand-made frames ---------------------------------------------------- */

typedef enum { V_UINT, V_INT, V_DBL, V_STR, V_BOOL, V_NIL, V_INTS, V_MAP, V_BIN, V_INTKEY } vkind;
typedef struct {
    const char *k;
    vkind t;
    long long i;
    double d;
    const char *s;
    const int *a;
    int n;
} field;

static void pack_value(msgpack_packer *pk, const field *f)
{
    switch (f->t) {
    case V_UINT: msgpack_pack_uint64(pk, (uint64_t)f->i); break;
    case V_INT: msgpack_pack_int64(pk, f->i); break;
    case V_DBL: msgpack_pack_double(pk, f->d); break;
    case V_STR:
        msgpack_pack_str(pk, strlen(f->s));
        msgpack_pack_str_body(pk, f->s, strlen(f->s));
        break;
    case V_BOOL:
        if (f->i) msgpack_pack_true(pk);
        else msgpack_pack_false(pk);
        break;
    case V_NIL: msgpack_pack_nil(pk); break;
    case V_INTS:
        msgpack_pack_array(pk, (size_t)f->n);
        for (int j = 0; j < f->n; j++) msgpack_pack_int64(pk, f->a[j]);
        break;
    case V_MAP: msgpack_pack_map(pk, 0); break;
    case V_BIN:
        msgpack_pack_bin(pk, 2);
        msgpack_pack_bin_body(pk, "ab", 2);
        break;
    case V_INTKEY: msgpack_pack_int64(pk, f->i); break;
    }
}

/* A map of the fields; a field of kind V_INTKEY has an integer key. */
static msgpack_sbuffer pack_fields(const field *f, int n)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, (size_t)n);
    for (int i = 0; i < n; i++) {
        if (f[i].t == V_INTKEY) {
            msgpack_pack_int64(&pk, 5);
            msgpack_pack_int64(&pk, f[i].i);
            continue;
        }
        msgpack_pack_str(&pk, strlen(f[i].k));
        msgpack_pack_str_body(&pk, f[i].k, strlen(f[i].k));
        pack_value(&pk, &f[i]);
    }
    return sb;
}

static void expect_refused(const void *data, size_t len, fr_status want, const char *needle)
{
    fr_msg d;
    d.type = FR_MSG_STATS;
    fr_status st = fr_msg_decode(data, len, &d);
    if (st != want) fail_msg("expected status %d for \"%s\", got %d (%s)", (int)want, needle, (int)st, fr_last_error());
    assert_int_equal(d.type, FR_MSG_NONE);
    fr_test_error_has(needle);
}

static void expect_fields_refused(const field *f, int n, fr_status want, const char *needle)
{
    msgpack_sbuffer sb = pack_fields(f, n);
    expect_refused(sb.data, sb.size, want, needle);
    msgpack_sbuffer_destroy(&sb);
}

static void expect_fields_ok(const field *f, int n, fr_msg *out)
{
    msgpack_sbuffer sb = pack_fields(f, n);
    if (fr_msg_decode(sb.data, sb.size, out)) fail_msg("refused: %s", fr_last_error());
    msgpack_sbuffer_destroy(&sb);
}

#define TYPE(name) {.k = "type", .t = V_STR, .s = name}
#define V1 {.k = "v", .t = V_UINT, .i = 1}
#define N(a) ((int)(sizeof(a) / sizeof((a)[0])))

static void test_frame_level_errors(void **state)
{
    (void)state;
    expect_refused("", 0, FR_EFORMAT, "frame 0 is empty");
    expect_refused("\xc1", 1, FR_EFORMAT, "not valid msgpack");
    expect_refused("\x82\xa4type", 6, FR_EFORMAT, "ends inside a msgpack value");
    expect_refused("\x92\x01\x02", 3, FR_EFORMAT, "must be a msgpack map, got an array");
    expect_refused("\x80\x80", 2, FR_EFORMAT, "1 bytes follow the msgpack map");
    expect_refused("\x80", 1, FR_EFORMAT, "missing key \"type\"");
    /* A few bytes declaring a huge container or string are refused before
     * the unpacker reserves memory for it (found by tests/fuzz). */
    expect_refused("\x81\xa1\x78\xdd\x08\x00\x00\x00", 8, FR_EFORMAT, "declares lengths");
    expect_refused("\x81\xa1\x78\xdf\x7f\xff\xff\xff", 8, FR_EFORMAT, "declares lengths");
    expect_refused("\x81\xa1\x78\xdb\x7f\xff\xff\xff", 8, FR_EFORMAT, "declares lengths");
    uint64_t pid;
    assert_false(fr_msg_peek_request_id("\x81\xa1\x78\xdd\x08\x00\x00\x00", 8, &pid));
    assert_int_equal(fr_msg_peek_type("\x81\xa1\x78\xdd\x08\x00\x00\x00", 8), FR_MSG_NONE);

    field no_v[] = {TYPE("hello")};
    /* no version is no version this side speaks (docs/protocol.md, "Strictness") */
    expect_fields_refused(no_v, N(no_v), FR_EUNSUPPORTED, "missing key \"v\"");
    field v2[] = {TYPE("hello"), {.k = "v", .t = V_UINT, .i = 2}};
    expect_fields_refused(v2, N(v2), FR_EUNSUPPORTED, "protocol version 2 is not supported");
    field vstr[] = {TYPE("hello"), {.k = "v", .t = V_STR, .s = "1"}};
    expect_fields_refused(vstr, N(vstr), FR_EFORMAT, "\"v\" must be an integer, got a string");
    field tint[] = {{.k = "type", .t = V_INT, .i = 3}, V1};
    expect_fields_refused(tint, N(tint), FR_EFORMAT, "\"type\" must be a string, got an integer");
    field unknown[] = {TYPE("fly"), V1};
    expect_fields_refused(unknown, N(unknown), FR_EFORMAT, "unknown type \"fly\"");
    field extra[] = {TYPE("resume"), V1, {.k = "now", .t = V_BOOL, .i = 1}};
    expect_fields_refused(extra, N(extra), FR_EFORMAT, "resume: unknown key \"now\"");
    field twice[] = {TYPE("stats"), V1, V1};
    expect_fields_refused(twice, N(twice), FR_EFORMAT, "key \"v\" given twice");
    field intkey[] = {TYPE("stats"), V1, {.t = V_INTKEY, .i = 1}};
    expect_fields_refused(intkey, N(intkey), FR_EFORMAT, "keys must be strings, found an integer");
    field hello_bad[] = {TYPE("hello"), V1, {.k = "client", .t = V_BIN}};
    expect_fields_refused(hello_bad, N(hello_bad), FR_EFORMAT, "\"client\" must be a string, got binary data");
}

static const int P3[] = {256, 1, 2};
static const int PNEG[] = {256, -1};

/* A generate with one field replaced (or, with drop set, left out). */
static void expect_generate_refused(const field *change, const char *drop, const char *needle)
{
    field f[16] = {TYPE("generate"), V1, {.k = "request_id", .t = V_UINT, .i = 4},
                   {.k = "prompt", .t = V_INTS, .a = P3, .n = 3}, {.k = "n", .t = V_INT, .i = 2}};
    int n = 5;
    for (int i = 0; drop && i < n; i++)
        if (strcmp(f[i].k, drop) == 0) {
            memmove(&f[i], &f[i + 1], sizeof(field) * (size_t)(n - i - 1));
            n--;
            break;
        }
    if (change) {
        int at = n;
        for (int i = 0; i < n; i++)
            if (strcmp(f[i].k, change->k) == 0) at = i;
        f[at] = *change;
        if (at == n) n++;
    }
    expect_fields_refused(f, n, FR_EFORMAT, needle);
    /* The error can still name the request it meant when the id is readable. */
    msgpack_sbuffer sb = pack_fields(f, n);
    uint64_t id = 0;
    int has = fr_msg_peek_request_id(sb.data, sb.size, &id);
    int id_ok = !drop || strcmp(drop, "request_id") != 0;
    if (change && strcmp(change->k, "request_id") == 0) id_ok = 0;
    assert_int_equal(has, id_ok);
    if (has) assert_true(id == 4);
    msgpack_sbuffer_destroy(&sb);
}

static void test_generate_errors(void **state)
{
    (void)state;
    expect_generate_refused(NULL, "request_id", "generate: missing key \"request_id\"");
    expect_generate_refused(NULL, "prompt", "missing key \"prompt\"");
    field c;
    c = (field){.k = "request_id", .t = V_INT, .i = -4};
    expect_generate_refused(&c, NULL, "\"request_id\" must be an integer >= 0, got a negative integer");
    c = (field){.k = "request_id", .t = V_STR, .s = "4"};
    expect_generate_refused(&c, NULL, "\"request_id\" must be an integer >= 0, got a string");
    c = (field){.k = "request_id", .t = V_NIL};
    expect_generate_refused(&c, NULL, "\"request_id\" must be an integer >= 0, got nil");
    c = (field){.k = "prompt", .t = V_STR, .s = "hello"};
    expect_generate_refused(&c, NULL, "\"prompt\" must be an array, got a string");
    c = (field){.k = "prompt", .t = V_INTS, .a = P3, .n = 0};
    expect_generate_refused(&c, NULL, "\"prompt\" must hold 1");
    c = (field){.k = "prompt", .t = V_INTS, .a = PNEG, .n = 2};
    expect_generate_refused(&c, NULL, "\"prompt\"[1] must be in [0, ");
    c = (field){.k = "n", .t = V_INT, .i = 0};
    expect_generate_refused(&c, NULL, "\"n\" must be in [1, 65536], got 0");
    c = (field){.k = "n", .t = V_DBL, .d = 2.0};
    expect_generate_refused(&c, NULL, "\"n\" must be an integer, got a float");
    c = (field){.k = "temperature", .t = V_STR, .s = "hot"};
    expect_generate_refused(&c, NULL, "\"temperature\" must be a number, got a string");
    c = (field){.k = "temperature", .t = V_DBL, .d = -0.5};
    expect_generate_refused(&c, NULL, "\"temperature\" must be a finite number >= 0");
    c = (field){.k = "temperature", .t = V_DBL, .d = NAN};
    expect_generate_refused(&c, NULL, "\"temperature\" must be a finite number >= 0");
    c = (field){.k = "top_p", .t = V_DBL, .d = 0.0};
    expect_generate_refused(&c, NULL, "\"top_p\" must be in (0, 1]");
    c = (field){.k = "top_p", .t = V_DBL, .d = 1.5};
    expect_generate_refused(&c, NULL, "\"top_p\" must be in (0, 1]");
    c = (field){.k = "top_k", .t = V_INT, .i = -1};
    expect_generate_refused(&c, NULL, "\"top_k\" must be in [0, ");
    c = (field){.k = "max_tokens", .t = V_INT, .i = 0};
    expect_generate_refused(&c, NULL, "\"max_tokens\" must be in [1, ");
    c = (field){.k = "stop_token_ids", .t = V_UINT, .i = 3};
    expect_generate_refused(&c, NULL, "\"stop_token_ids\" must be an array, got an integer");
    c = (field){.k = "seed", .t = V_INT, .i = -1};
    expect_generate_refused(&c, NULL, "\"seed\" must be an integer >= 0");
    c = (field){.k = "first_sample", .t = V_INT, .i = -1};
    expect_generate_refused(&c, NULL, "\"first_sample\" must be in [0, 2147483645], got -1");
    c = (field){.k = "first_sample", .t = V_INT, .i = 2147483646};   /* no room for n = 2 */
    expect_generate_refused(&c, NULL, "\"first_sample\" must be in [0, 2147483645], got 2147483646");
    c = (field){.k = "logprobs", .t = V_INT, .i = 21};
    expect_generate_refused(&c, NULL, "\"logprobs\" must be in [0, 20], got 21");
    c = (field){.k = "min_tokens", .t = V_INT, .i = -2};
    expect_generate_refused(&c, NULL, "\"min_tokens\" must be in [0, ");
    c = (field){.k = "prompt_logprobs", .t = V_INT, .i = 1};
    expect_generate_refused(&c, NULL, "\"prompt_logprobs\" must be a boolean, got an integer");
    {   /* min_tokens above the request's own max_tokens */
        field f[] = {TYPE("generate"), V1, {.k = "request_id", .t = V_UINT, .i = 4},
                     {.k = "prompt", .t = V_INTS, .a = P3, .n = 3}, {.k = "max_tokens", .t = V_INT, .i = 5},
                     {.k = "min_tokens", .t = V_INT, .i = 6}};
        expect_fields_refused(f, N(f), FR_EFORMAT, "\"min_tokens\" (6) must not exceed \"max_tokens\" (5)");
    }
    c = (field){.k = "group_id", .t = V_DBL, .d = 1.0};
    expect_generate_refused(&c, NULL, "\"group_id\" must be an integer >= 0, got a float");
    c = (field){.k = "monitor_divergence", .t = V_INT, .i = 1};
    expect_generate_refused(&c, NULL, "\"monitor_divergence\" must be a boolean, got an integer");
    c = (field){.k = "temprature", .t = V_DBL, .d = 1.0};
    expect_generate_refused(&c, NULL, "generate: unknown key \"temprature\"");

    /* nil for an optional field means "absent"; integers are numbers. */
    field ok[] = {TYPE("generate"), V1, {.k = "request_id", .t = V_UINT, .i = 4},
                  {.k = "prompt", .t = V_INTS, .a = P3, .n = 3}, {.k = "temperature", .t = V_INT, .i = 1},
                  {.k = "top_p", .t = V_NIL}, {.k = "seed", .t = V_NIL}, {.k = "stop_token_ids", .t = V_NIL}};
    fr_msg d;
    expect_fields_ok(ok, N(ok), &d);
    assert_int_equal(d.u.generate.n, 1);
    assert_true(d.u.generate.has_temperature && d.u.generate.temperature == 1.0);
    assert_false(d.u.generate.has_top_p || d.u.generate.has_seed || d.u.generate.has_stop_token_ids);
    fr_msg_free(&d);
}

static const int IDS2[] = {1, 2};

static void test_other_client_message_errors(void **state)
{
    (void)state;
    field both[] = {TYPE("abort"), V1, {.k = "all", .t = V_BOOL, .i = 1}, {.k = "request_ids", .t = V_INTS, .a = IDS2, .n = 2}};
    expect_fields_refused(both, N(both), FR_EFORMAT, "not both");
    field neither[] = {TYPE("abort"), V1};
    expect_fields_refused(neither, N(neither), FR_EFORMAT, "at least one id");
    field none_false[] = {TYPE("abort"), V1, {.k = "all", .t = V_BOOL, .i = 0}};
    expect_fields_refused(none_false, N(none_false), FR_EFORMAT, "at least one id");
    field empty_ids[] = {TYPE("abort"), V1, {.k = "request_ids", .t = V_INTS, .a = IDS2, .n = 0}};
    expect_fields_refused(empty_ids, N(empty_ids), FR_EFORMAT, "at least one id");
    field neg_ids[] = {TYPE("abort"), V1, {.k = "request_ids", .t = V_INTS, .a = PNEG, .n = 2}};
    expect_fields_refused(neg_ids, N(neg_ids), FR_EFORMAT, "\"request_ids\"[1] must be an integer >= 0");
    field mode[] = {TYPE("pause"), V1, {.k = "mode", .t = V_STR, .s = "soon"}};
    expect_fields_refused(mode, N(mode), FR_EFORMAT, "\"mode\" must be \"abort\", \"wait\" or \"keep\", got \"soon\"");
    field no_mode[] = {TYPE("pause"), V1};
    expect_fields_refused(no_mode, N(no_mode), FR_EFORMAT, "pause: missing key \"mode\"");
    field mode_int[] = {TYPE("pause"), V1, {.k = "mode", .t = V_INT, .i = 1}};
    expect_fields_refused(mode_int, N(mode_int), FR_EFORMAT, "\"mode\" must be a string");
}

static const int TOK3[] = {1, 2, 3};

static void test_server_message_errors(void **state)
{
    (void)state;
    field tok[] = {TYPE("tokens"), V1, {.k = "request_id", .t = V_UINT, .i = 1}, {.k = "sample", .t = V_INT, .i = 0},
                   {.k = "start", .t = V_INT, .i = 0}, {.k = "token_ids", .t = V_INTS, .a = TOK3, .n = 3},
                   {.k = "logprobs", .t = V_INTS, .a = PNEG, .n = 2},
                   {.k = "weight_versions", .t = V_INTS, .a = TOK3, .n = 3}};
    expect_fields_refused(tok, N(tok), FR_EFORMAT, "must have one length, got 3, 2, 3");
    field done[] = {TYPE("done"), V1, {.k = "request_id", .t = V_UINT, .i = 1}, {.k = "group_id", .t = V_UINT, .i = 1},
                    {.k = "sample", .t = V_INT, .i = 0}, {.k = "finish_reason", .t = V_STR, .s = "tired"},
                    {.k = "n_tokens", .t = V_INT, .i = 0}, {.k = "n_prompt", .t = V_INT, .i = 3},
                    {.k = "preemptions", .t = V_INT, .i = 0}, {.k = "ttft_ms", .t = V_NIL},
                    {.k = "total_ms", .t = V_DBL, .d = 1.0}, {.k = "divergence", .t = V_MAP}};
    expect_fields_refused(done, N(done), FR_EFORMAT, "\"finish_reason\" must be stop, length, abort or error");
    done[5].s = "abort";
    expect_fields_refused(done, N(done), FR_EFORMAT, "missing key \"divergence.kl_mean\"");
    field err[] = {TYPE("error"), V1, {.k = "code", .t = V_STR, .s = "bad_message"}, {.k = "message", .t = V_STR, .s = "x"}};
    expect_fields_refused(err, N(err), FR_EFORMAT, "missing key \"request_id\"");
    field pr[] = {TYPE("pause_reply"), V1, {.k = "mode", .t = V_STR, .s = "wait"}, {.k = "state", .t = V_STR, .s = "running"},
                  {.k = "aborted", .t = V_INT, .i = 0}};
    expect_fields_refused(pr, N(pr), FR_EFORMAT, "\"state\" must be \"paused\"");
    field sr[] = {TYPE("stats_reply"), V1, {.k = "scheduler", .t = V_MAP}, {.k = "server", .t = V_MAP}};
    expect_fields_refused(sr, N(sr), FR_EFORMAT, "missing key \"scheduler.running\"");

    /* A NaN figure is still a number: it travels as one. */
    fr_msg m;
    fr_msg_init(&m, FR_MSG_DONE);
    m.u.done.total_ms = 1;
    m.u.done.divergence = (fr_msg_divergence){.has_values = 1, .kl_mean = NAN};
    char *data;
    size_t len;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_OK);   /* NaN is a number on the wire */
    fr_msg d;
    assert_int_equal(fr_msg_decode(data, len, &d), FR_OK);
    assert_true(isnan(d.u.done.divergence.kl_mean));
    free(data);
}

static void test_peek_request_id(void **state)
{
    (void)state;
    uint64_t id = 0;
    assert_false(fr_msg_peek_request_id(NULL, 0, &id));
    assert_false(fr_msg_peek_request_id("\xc1", 1, &id));
    field f[] = {TYPE("generate"), {.k = "request_id", .t = V_UINT, .i = 123}};
    msgpack_sbuffer sb = pack_fields(f, N(f));
    assert_true(fr_msg_peek_request_id(sb.data, sb.size, &id));
    assert_true(id == 123);
    assert_int_equal(fr_msg_peek_type(sb.data, sb.size), FR_MSG_GENERATE);
    msgpack_sbuffer_destroy(&sb);
    assert_int_equal(fr_msg_peek_type("\xc1", 1), FR_MSG_NONE);
    field t[] = {TYPE("tokens")};
    sb = pack_fields(t, N(t));
    assert_int_equal(fr_msg_peek_type(sb.data, sb.size), FR_MSG_TOKENS);
    msgpack_sbuffer_destroy(&sb);
    field u[] = {TYPE("dance")};
    sb = pack_fields(u, N(u));
    assert_int_equal(fr_msg_peek_type(sb.data, sb.size), FR_MSG_NONE);
    msgpack_sbuffer_destroy(&sb);
}

/* Every prefix of a valid frame is refused without reading past its end. */
static void test_truncated_frames(void **state)
{
    (void)state;
    int prompt[] = {256, 1, 2, 3};
    fr_msg m;
    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate.request_id = 5;
    m.u.generate.prompt = prompt;
    m.u.generate.n_prompt = 4;
    m.u.generate.has_temperature = 1;
    m.u.generate.temperature = 0.5;
    char *data;
    size_t len;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_OK);
    for (size_t cut = 0; cut < len; cut++) {
        char *copy = malloc(cut ? cut : 1);
        memcpy(copy, data, cut);
        fr_msg d;
        assert_int_not_equal(fr_msg_decode(copy, cut, &d), FR_OK);
        free(copy);
    }
    free(data);
}

/* Strings on the wire are UTF-8 (docs/protocol.md, "Strings"). */
static void test_utf8(void **state)
{
    (void)state;
    assert_true(fr_utf8_valid("", 0));
    assert_true(fr_utf8_valid("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", 14));
    assert_false(fr_utf8_valid("\xff\xfe", 2));
    assert_false(fr_utf8_valid("\xc3\x28", 2));           /* bad continuation */
    assert_false(fr_utf8_valid("\xc0\xaf", 2));           /* overlong */
    assert_false(fr_utf8_valid("\xed\xa0\x80", 3));       /* a surrogate */
    assert_false(fr_utf8_valid("\xf4\x90\x80\x80", 4));   /* above U+10FFFF */
    assert_false(fr_utf8_valid("\xe2\x82", 2));           /* cut short */
    char out[64];
    assert_int_equal(fr_utf8_escape("a\xff\xc3\xa9", 4, out, sizeof out), 7);
    assert_string_equal(out, "a\\xff\xc3\xa9");
    assert_true(fr_utf8_valid(out, strlen(out)));
    /* an unknown type of non-UTF-8 bytes: refused, and the message is UTF-8 */
    static const unsigned char bad_type[] = {0x82, 0xa4, 't', 'y', 'p', 'e', 0xa2, 0xff, 0xfe, 0xa1, 'v', 0x01};
    expect_refused(bad_type, sizeof bad_type, FR_EFORMAT, "type \"\\xff\\xfe\"");
    assert_true(fr_utf8_valid(fr_last_error(), strlen(fr_last_error())));
    /* a string value that is not UTF-8: refused */
    static const unsigned char bad_client[] = {0x83, 0xa4, 't', 'y', 'p', 'e', 0xa5, 'h', 'e', 'l', 'l', 'o', 0xa1, 'v',
                                               0x01, 0xa6, 'c', 'l', 'i', 'e', 'n', 't', 0xa2, 0xc3, 0x28};
    expect_refused(bad_client, sizeof bad_client, FR_EFORMAT, "\"client\" is not valid UTF-8");
    /* the encoder escapes what is not UTF-8 (an error quoting a client's bytes) */
    fr_msg m;
    fr_msg_init(&m, FR_MSG_ERROR);
    snprintf(m.u.error.code, sizeof m.u.error.code, "bad_message");
    snprintf(m.u.error.message, sizeof m.u.error.message, "key \"\xff\"");
    char *data;
    size_t len;
    assert_int_equal(fr_msg_encode(&m, &data, &len), FR_OK);
    fr_msg d;
    assert_int_equal(fr_msg_decode(data, len, &d), FR_OK);
    assert_string_equal(d.u.error.message, "key \"\\xff\"");
    fr_msg_free(&d);
    free(data);
}

/* Arrays longer than a bound are refused before anything is unpacked. */
static void test_check_bounds(void **state)
{
    (void)state;
    static const unsigned char arr16[] = {0x81, 0xa1, 'p', 0xdc, 0x01, 0x00};   /* declares 256 entries */
    assert_int_equal(fr_msg_check_bounds(arr16, sizeof arr16, 256), FR_OK);
    assert_int_equal(fr_msg_check_bounds(arr16, sizeof arr16, 255), FR_EFORMAT);
    fr_test_error_has("declares 256 entries");
    static const unsigned char fix[] = {0x81, 0xa1, 'p', 0x93, 1, 2, 3};
    assert_int_equal(fr_msg_check_bounds(fix, sizeof fix, 3), FR_OK);
    assert_int_equal(fr_msg_check_bounds(fix, sizeof fix, 2), FR_EFORMAT);
}

/* fr_wire_monitor_event on a real monitor: nothing queued gives 0; a
 * connection accepted and then closed by its peer gives ACCEPTED and then
 * DISCONNECTED, both naming the same file descriptor. */
static void test_monitor_events(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new(), *router = zmq_socket(ctx, ZMQ_ROUTER), *mon = zmq_socket(ctx, ZMQ_PAIR);
    assert_int_equal(zmq_bind(router, "tcp://127.0.0.1:*"), 0);
    assert_int_equal(zmq_socket_monitor(router, "inproc://test-monitor", ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED), 0);
    assert_int_equal(zmq_connect(mon, "inproc://test-monitor"), 0);
    uint16_t event = 1;
    int32_t fd = 0, accepted_fd = -1;
    assert_int_equal(fr_wire_monitor_event(mon, &event, &fd), 0);
    char endpoint[256];
    size_t len = sizeof endpoint;
    assert_int_equal(zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, endpoint, &len), 0);
    void *dealer = zmq_socket(ctx, ZMQ_DEALER);
    assert_int_equal(zmq_connect(dealer, endpoint), 0);
    int closed = 0;
    for (int i = 0; i < 2000 && !closed; i++) {   /* 20 s at most */
        if (!fr_wire_monitor_event(mon, &event, &fd)) {
            zmq_pollitem_t it = {.socket = mon, .events = ZMQ_POLLIN};
            zmq_poll(&it, 1, 10);
            continue;
        }
        if (event == ZMQ_EVENT_ACCEPTED) {
            assert_true(fd >= 0);
            accepted_fd = fd;
            zmq_close(dealer);   /* the peer goes: the router sees the connection end */
            dealer = NULL;
        } else if (event == ZMQ_EVENT_DISCONNECTED) {
            assert_int_equal(fd, accepted_fd);
            closed = 1;
        }
    }
    assert_true(closed);
    if (dealer) zmq_close(dealer);
    zmq_socket_monitor(router, NULL, 0);
    zmq_close(mon);
    zmq_close(router);
    zmq_ctx_term(ctx);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_hello_and_empty_messages),
             cmocka_unit_test(test_generate_full_and_minimal),
             cmocka_unit_test(test_abort),
             cmocka_unit_test(test_hello_reply),
             cmocka_unit_test(test_tokens),
             cmocka_unit_test(test_done),
             cmocka_unit_test(test_stats_reply_and_error),
             cmocka_unit_test(test_encode_refuses_invalid),
             cmocka_unit_test(test_frame_level_errors),
             cmocka_unit_test(test_generate_errors),
             cmocka_unit_test(test_other_client_message_errors),
             cmocka_unit_test(test_server_message_errors),
             cmocka_unit_test(test_peek_request_id),
             cmocka_unit_test(test_truncated_frames),
             cmocka_unit_test(test_utf8),
             cmocka_unit_test(test_check_bounds),
             cmocka_unit_test(test_monitor_events))
