/* Writes the seed inputs of the protocol and safetensors fuzz targets:
 * one valid frame per message type, made by the codec's own encoder, and a
 * few small valid safetensors images. `gen_seeds DIR` writes them under
 * DIR/protocol and DIR/safetensors (which must exist); the committed corpus
 * in tests/fuzz/corpus was made so (make fuzz-seeds). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/protocol_samples.h"
#include "trainer_bridge/protocol/protocol.h"

static const char *dir;

static void put(const char *sub, const char *name, const void *data, size_t len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/%s", dir, sub, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
        fprintf(stderr, "gen_seeds: cannot write %s\n", path);
        exit(1);
    }
}

static void frame(const char *name, const fr_msg *m)
{
    char *data = NULL;
    size_t len = 0;
    if (fr_msg_encode(m, &data, &len) != FR_OK) {
        fprintf(stderr, "gen_seeds: %s: %s\n", name, fr_last_error());
        exit(1);
    }
    put("protocol", name, data, len);
    free(data);
}

/* A client's messages to the server. */
static void protocol_request_seeds(void)
{
    fr_msg m;
    int prompt[] = {151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30};
    int stops[] = {151645, 151643};
    uint64_t ids[] = {7, 8, 1ull << 40};

    fr_msg_init(&m, FR_MSG_HELLO);
    snprintf(m.u.hello.client, sizeof m.u.hello.client, "trainer-0");
    frame("hello", &m);

    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate.request_id = 42;
    m.u.generate.prompt = prompt;
    m.u.generate.n_prompt = 10;
    frame("generate_min", &m);
    m.u.generate.has_group_id = 1;
    m.u.generate.group_id = 9;
    m.u.generate.n = 4;
    m.u.generate.has_temperature = m.u.generate.has_top_k = m.u.generate.has_top_p = 1;
    m.u.generate.temperature = 0.7;
    m.u.generate.top_k = 20;
    m.u.generate.top_p = 0.95;
    m.u.generate.has_max_tokens = m.u.generate.has_stop_token_ids = m.u.generate.has_seed = 1;
    m.u.generate.max_tokens = 128;
    m.u.generate.stop_token_ids = stops;
    m.u.generate.n_stop_token_ids = 2;
    m.u.generate.seed = 1234;
    m.u.generate.monitor_divergence = 1;
    frame("generate_full", &m);

    fr_msg_init(&m, FR_MSG_ABORT);
    m.u.abort.request_ids = ids;
    m.u.abort.n_request_ids = 3;
    frame("abort_ids", &m);
    fr_msg_init(&m, FR_MSG_ABORT);
    m.u.abort.all = 1;
    frame("abort_all", &m);

    fr_msg_init(&m, FR_MSG_PAUSE);
    m.u.pause.mode = FR_PAUSE_WAIT;
    frame("pause", &m);
    fr_msg_init(&m, FR_MSG_RESUME);
    frame("resume", &m);
    fr_msg_init(&m, FR_MSG_STATS);
    frame("stats", &m);

}

/* The server's messages to a client. */
static void protocol_reply_seeds(void)
{
    fr_msg m;
    uint64_t ids[] = {7, 8, 1ull << 40};

    fr_sample_hello_reply(&m);
    frame("hello_reply", &m);

    fr_sample_tokens(&m);
    frame("tokens", &m);

    fr_msg_init(&m, FR_MSG_DONE);
    fr_msg_done *d = &m.u.done;
    d->request_id = 42;
    d->group_id = 9;
    d->sample = 1;
    d->finish_reason = FR_WIRE_LENGTH;
    d->n_tokens = 128;
    d->n_prompt = 10;
    d->preemptions = 1;
    d->total_ms = 812.5;
    frame("done_plain", &m);
    d->finish_reason = FR_WIRE_STOP;
    d->has_ttft = 1;
    d->ttft_ms = 12.25;
    d->divergence = (fr_msg_divergence){.has_values = 1, .kl_mean = 0.002, .kl_max = 0.04,
                                        .top1_agreement = 0.99, .logprob_diff_mean = -0.001, .positions = 96};
    frame("done_divergence", &m);

    fr_msg_init(&m, FR_MSG_ABORT_REPLY);
    m.u.abort_reply.samples = 4;
    m.u.abort_reply.not_found = ids;
    m.u.abort_reply.n_not_found = 1;
    frame("abort_reply", &m);

    fr_msg_init(&m, FR_MSG_PAUSE_REPLY);
    m.u.pause_reply.mode = FR_PAUSE_ABORT;
    m.u.pause_reply.aborted = 2;
    frame("pause_reply", &m);

    fr_msg_init(&m, FR_MSG_RESUME_REPLY);
    m.u.resume_reply.released = 3;
    frame("resume_reply", &m);

    fr_msg_init(&m, FR_MSG_STATS_REPLY);
    fr_msg_stats_reply *s = &m.u.stats_reply;
    s->running = 3;
    s->prefilling = 1;
    s->waiting = 2;
    s->preemptions = 1;
    s->tokens_generated = 5000;
    s->prefill_tokens = 700;
    s->steps = 90;
    s->finished = 12;
    s->kv_blocks_used = 40;
    s->kv_blocks_free = 216;
    snprintf(s->state, sizeof s->state, "running");
    s->weight_version = 3;
    s->clients = 1;
    s->open_requests = 2;
    s->messages_in = s->messages_out = 30;
    s->requests_accepted = 14;
    s->samples_done = 12;
    s->tokens_streamed = 5000;
    frame("stats_reply", &m);

    fr_msg_init(&m, FR_MSG_ERROR);
    snprintf(m.u.error.code, sizeof m.u.error.code, "invalid_request");
    snprintf(m.u.error.message, sizeof m.u.error.message, "generate: \"prompt\" must hold 1 to 16777216 entries");
    m.u.error.has_request_id = 1;
    m.u.error.request_id = 42;
    frame("error", &m);
}

/* A safetensors image: the 8-byte length, the header padded with spaces to
 * a multiple of 8, then `data_len` bytes of data (a byte ramp). */
static void image(const char *name, const char *header, size_t data_len)
{
    size_t hlen = strlen(header), padded = (hlen + 7) / 8 * 8;
    size_t len = 8 + padded + data_len;
    uint8_t *buf = malloc(len);
    if (!buf) exit(1);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, header, hlen);
    memset(buf + 8 + hlen, ' ', padded - hlen);
    for (size_t i = 0; i < data_len; i++) buf[8 + padded + i] = (uint8_t)(i * 37 + 11);
    put("safetensors", name, buf, len);
    free(buf);
}

static void safetensors_seeds(void)
{
    image("one_f32", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", 24);
    image("mixed",
          "{\"__metadata__\":{\"format\":\"pt\"},"
          "\"model.embed_tokens.weight\":{\"dtype\":\"BF16\",\"shape\":[4,2],\"data_offsets\":[0,16]},"
          "\"model.norm.weight\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[16,20]},"
          "\"lm_head.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[20,36]},"
          "\"step\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[36,44]}}",
          44);
    image("every_dtype",
          "{\"a\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]},"
          "\"b\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[8,12]},"
          "\"c\":{\"dtype\":\"I16\",\"shape\":[1],\"data_offsets\":[12,14]},"
          "\"d\":{\"dtype\":\"I8\",\"shape\":[1],\"data_offsets\":[14,15]},"
          "\"e\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[15,16]},"
          "\"f\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[16,17]},"
          "\"g\":{\"dtype\":\"F16\",\"shape\":[0,5],\"data_offsets\":[17,17]}}",
          17);
    image("empty", "{}", 0);
    image("metadata_only", "{\"__metadata__\":{\"format\":\"pt\",\"step\":\"100\"}}", 0);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_seeds DIR\n");
        return 2;
    }
    dir = argv[1];
    protocol_request_seeds();
    protocol_reply_seeds();
    safetensors_seeds();
    return 0;
}
