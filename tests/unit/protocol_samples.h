/* Server messages filled with fixed values, each field different from the
 * others so that a codec swapping two of them shows in a round trip. Shared
 * by the protocol unit tests and the fuzz seeds (tests/fuzz/gen_seeds.c,
 * which links no test code: header-only). */
#ifndef FR_TEST_PROTOCOL_SAMPLES_H
#define FR_TEST_PROTOCOL_SAMPLES_H

#include <stdint.h>
#include <stdio.h>

#include "trainer_bridge/protocol/protocol.h"

static inline void fr_sample_hello_reply(fr_msg *m)
{
    fr_msg_init(m, FR_MSG_HELLO_REPLY);
    fr_msg_hello_reply *h = &m->u.hello_reply;
    snprintf(h->server, sizeof h->server, "fp4rollout");
    snprintf(h->model, sizeof h->model, "tq6");
    snprintf(h->backend, sizeof h->backend, "cpu");
    snprintf(h->kv_dtype, sizeof h->kv_dtype, "nvfp4");
    h->tp = 1;
    h->engines = 2;
    h->weight_version = 3;
    h->max_seqs = 16;
    h->kv_blocks = 256;
    h->kv_block_tokens = 128;
    h->max_model_len = 4096;
    h->vocab_size = 151936;
    h->eos_token_ids[0] = 151645;
    h->eos_token_ids[1] = 151643;
    h->n_eos_token_ids = 2;
    h->chunk = 512;
}

/* Three streamed tokens of request 42's sample 1 from position 5; the arrays
 * are the function's own (static). */
static inline void fr_sample_tokens(fr_msg *m)
{
    static int toks[] = {19, 220, 19};
    static float lps[] = {-0.25f, -1.5f, 0.0f};
    static uint64_t wvs[] = {3, 3, 4};
    fr_msg_init(m, FR_MSG_TOKENS);
    m->u.tokens.request_id = 42;
    m->u.tokens.sample = 1;
    m->u.tokens.start = 5;
    m->u.tokens.n = 3;
    m->u.tokens.token_ids = toks;
    m->u.tokens.logprobs = lps;
    m->u.tokens.weight_versions = wvs;
}

#endif
