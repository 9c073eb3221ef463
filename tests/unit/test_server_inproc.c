/* The trainer bridge's server in this process (trainer_bridge/server/server.h):
 * its loop runs on a thread, bound to a free loopback port, over a CPU
 * session of a synthetic model, and the C client drives it: a generate, a
 * whole weight push (the server then answers as a server started on the
 * new weights does), two partial pushes that together bring the old
 * weights back, a push that is neither whole nor partial (refused, nothing
 * changes), and a frame that is not a message (an error, and the server
 * keeps serving). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "rollout/model/tensor_table.h"
#include "test_util.h"
#include "trainer_bridge/client/client.h"
#include "trainer_bridge/protocol/wire.h"

enum { MAX_NEW = 12, TIMEOUT_MS = 60000 };
static const int PROMPT[] = {256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100};

static fr_test_server *start(const char *spec)
{
    fr_test_server *l = NULL;
    assert_int_equal(fr_test_server_start(spec, 64, 4, MAX_NEW, &l), FR_OK);
    return l;
}

static void stop(fr_test_server *l) { assert_int_equal(fr_test_server_stop(&l), FR_OK); }

static fr_client *connect_to(fr_test_server *l)
{
    fr_client *c;
    assert_int_equal(fr_client_new(fr_test_server_endpoint(l), &c), FR_OK);
    fr_client_set_timeout(c, TIMEOUT_MS);
    return c;
}

/* Greedy tokens of PROMPT (2 samples, which must agree), and the weight
 * version every token reports (which must be one). */
static void greedy(fr_client *c, uint64_t id, int tokens[MAX_NEW], uint64_t *version)
{
    fr_msg g;
    fr_msg_init(&g, FR_MSG_GENERATE);
    g.u.generate = (fr_msg_generate){.request_id = id, .prompt = (int *)PROMPT,
                                     .n_prompt = (int)(sizeof PROMPT / sizeof PROMPT[0]), .n = 2,
                                     .has_temperature = 1, .temperature = 0, .has_max_tokens = 1,
                                     .max_tokens = MAX_NEW, .has_stop_token_ids = 1, .monitor_divergence = -1};
    assert_int_equal(fr_client_generate(c, &g.u.generate), FR_OK);
    int got[2][MAX_NEW], n[2] = {0, 0}, done = 0;
    *version = UINT64_MAX;
    while (done < 2) {
        fr_msg m;
        int have = 0;
        if (fr_client_next(c, TIMEOUT_MS, &m, &have)) fail_msg("generate: %s", fr_last_error());
        if (!have) fail_msg("generate: nothing came within %d ms", TIMEOUT_MS);
        if (m.type == FR_MSG_TOKENS) {
            const fr_msg_tokens *t = &m.u.tokens;
            assert_true(t->request_id == id && t->sample >= 0 && t->sample < 2);
            for (int k = 0; k < t->n; k++) {
                assert_true(t->start + k == n[t->sample] && n[t->sample] < MAX_NEW);
                got[t->sample][n[t->sample]++] = t->token_ids[k];
                if (*version == UINT64_MAX) *version = t->weight_versions[k];
                assert_true(t->weight_versions[k] == *version);
            }
        } else if (m.type == FR_MSG_DONE) {
            assert_int_equal(m.u.done.finish_reason, FR_WIRE_LENGTH);
            done++;
        } else {
            fail_msg("generate: unexpected message type %d", (int)m.type);
        }
        fr_msg_free(&m);
    }
    assert_int_equal(n[0], MAX_NEW);
    assert_int_equal(n[1], MAX_NEW);
    assert_memory_equal(got[0], got[1], sizeof got[0]);
    memcpy(tokens, got[0], sizeof got[0]);
}

/* The tensors of model spec, as the client sends them (float32), from
 * index `from` to `to` of the model's list. */
typedef struct {
    fr_model *m;
    fr_model_tensor *t;
    size_t n;
    fr_client_tensor *ct;
    int64_t (*shape)[2];
} tensors;

static void load_tensors(tensors *w, const char *spec)
{
    memset(w, 0, sizeof *w);
    assert_int_equal(fr_model_load(spec, &w->m), FR_OK);
    assert_int_equal(fr_model_tensor_list(&w->m->cfg, &w->m->w, &w->t, &w->n), FR_OK);
    w->ct = calloc(w->n, sizeof *w->ct);
    w->shape = calloc(w->n, sizeof *w->shape);
    assert_true(w->ct && w->shape);
    for (size_t i = 0; i < w->n; i++) {
        w->shape[i][0] = w->t[i].rows;
        w->shape[i][1] = w->t[i].cols;
        w->ct[i] = (fr_client_tensor){.name = w->t[i].name, .dtype = FR_DTYPE_F32, .ndim = w->t[i].ndim,
                                      .shape = w->shape[i], .data = w->t[i].data};
    }
}

static void free_tensors(tensors *w)
{
    free(w->ct);
    free(w->shape);
    free(w->t);
    fr_model_destroy(&w->m);
}

static fr_status push(fr_client *c, const tensors *w, size_t from, size_t to, uint64_t version, int partial)
{
    fr_client_update_opts opts = {.bucket_bytes = 1 << 16, .corrupt_bucket = -1, .partial = partial};
    fr_msg_update_reply r;
    fr_status st = fr_client_update_weights(c, w->ct + from, (int)(to - from), version, &opts, &r);
    if (!st) assert_true(r.weight_version == version);
    return st;
}

static void expect_server_error(fr_client *c, const char *code)
{
    const char *got_code = NULL, *msg = NULL;
    assert_true(fr_client_last_error(c, &got_code, &msg, NULL));
    if (strcmp(got_code, code) != 0) fail_msg("wanted %s, got %s: %s", code, got_code, msg);
}

/* A frame that is not msgpack, from a bare DEALER: an error with code
 * bad_message comes back. */
static void bad_frame(const char *endpoint)
{
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    assert_int_equal(zmq_connect(s, endpoint), 0);
    static const unsigned char junk[] = {0xc1, 0x00, 0xff, 0x13};
    fr_wire_result res;
    assert_int_equal(fr_wire_send(s, NULL, 0, junk, sizeof junk, &res), FR_OK);
    fr_wire_msg w;
    int got = 0;
    assert_int_equal(fr_wire_recv(s, 0, TIMEOUT_MS, &w, &got), FR_OK);
    assert_true(got);
    fr_msg m;
    assert_int_equal(fr_msg_decode(w.frame0, w.len0, &m), FR_OK);
    assert_int_equal(m.type, FR_MSG_ERROR);
    assert_string_equal(m.u.error.code, "bad_message");
    fr_msg_free(&m);
    fr_wire_msg_free(&w);
    zmq_close(s);
    zmq_ctx_term(ctx);
}

static void test_server_in_process(void **state)
{
    (void)state;
    fr_test_server *a = start("synthetic:tiny"), *b = start("synthetic:tiny:7");
    fr_client *ca = connect_to(a), *cb = connect_to(b);
    int t0[MAX_NEW], t7[MAX_NEW], t[MAX_NEW];
    uint64_t v;
    greedy(ca, 1, t0, &v);
    assert_true(v == 0);
    greedy(cb, 1, t7, &v);
    assert_true(memcmp(t0, t7, sizeof t0) != 0);

    tensors w7, w0;
    load_tensors(&w7, "synthetic:tiny:7");
    load_tensors(&w0, "synthetic:tiny");
    /* a whole push: a now answers as b does, its tokens carrying version 2 */
    assert_int_equal(push(ca, &w7, 0, w7.n, 2, 0), FR_OK);
    greedy(ca, 2, t, &v);
    assert_true(v == 2);
    assert_memory_equal(t, t7, sizeof t);
    /* neither whole nor partial: refused, version 2 keeps serving */
    assert_int_not_equal(push(ca, &w0, 0, 1, 3, 0), FR_OK);
    expect_server_error(ca, "missing_tensor");
    greedy(ca, 3, t, &v);
    assert_true(v == 2);
    assert_memory_equal(t, t7, sizeof t);
    /* two partial pushes, the embedding, then everything else of
     * synthetic:tiny: the first changes only the embedding, together they
     * bring synthetic:tiny back */
    assert_int_equal(push(ca, &w0, 0, 1, 3, 1), FR_OK);
    greedy(ca, 4, t, &v);
    assert_true(v == 3);
    assert_int_equal(push(ca, &w0, 1, w0.n, 4, 1), FR_OK);
    greedy(ca, 5, t, &v);
    assert_true(v == 4);
    assert_memory_equal(t, t0, sizeof t);
    /* a bad frame gets an error, and the server goes on */
    bad_frame(fr_test_server_endpoint(a));
    fr_msg_hello_reply hello;
    assert_int_equal(fr_client_hello(ca, "test", &hello), FR_OK);
    assert_true(hello.weight_version == 4);

    free_tensors(&w7);
    free_tensors(&w0);
    fr_client_destroy(&ca);
    fr_client_destroy(&cb);
    stop(a);
    stop(b);
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_server_in_process))
