/* libFuzzer target: the trainer bridge's message decoder
 * (trainer_bridge/protocol/protocol.h) on arbitrary frames.
 *
 * Beyond "no crash, no leak": a refused frame leaves the message cleared
 * with a message in fr_last_error(); the peek helpers agree with a
 * successful decode; and a decoded message re-encodes, decodes again and
 * encodes to the very same bytes (the codec's round trip). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/protocol/protocol.h"
#include "tests/fuzz/fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int has_request_id(const fr_msg *m, uint64_t *id)
{
    switch (m->type) {
    case FR_MSG_GENERATE: *id = m->u.generate.request_id; return 1;
    case FR_MSG_TOKENS: *id = m->u.tokens.request_id; return 1;
    case FR_MSG_DONE: *id = m->u.done.request_id; return 1;
    case FR_MSG_ERROR: *id = m->u.error.request_id; return m->u.error.has_request_id;
    default: return 0;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t peek_id = 0;
    int peeked = fr_msg_peek_request_id(data, size, &peek_id);
    fr_msg_type peek_type = fr_msg_peek_type(data, size);
    FUZZ_CHECK(peek_type >= FR_MSG_NONE && peek_type < FR_MSG_TYPE_COUNT, "peek type %d", (int)peek_type);

    fr_msg m;
    fr_status st = fr_msg_decode(data, size, &m);
    if (st != FR_OK) {
        FUZZ_CHECK(st == FR_EFORMAT || st == FR_EUNSUPPORTED || st == FR_ENOMEM, "status %d", (int)st);
        FUZZ_CHECK(m.type == FR_MSG_NONE, "a refused frame left type %d", (int)m.type);
        FUZZ_CHECK(fr_last_error()[0] != '\0', "a refused frame left no message");
        return 0;
    }

    FUZZ_CHECK(m.type > FR_MSG_NONE && m.type < FR_MSG_TYPE_COUNT, "decoded type %d", (int)m.type);
    FUZZ_CHECK(peek_type == m.type, "peek says %s, decode says %s", fr_msg_type_name(peek_type),
               fr_msg_type_name(m.type));
    uint64_t id = 0;
    if (has_request_id(&m, &id))
        FUZZ_CHECK(peeked && peek_id == id, "peek request_id %d/%llu, decoded %llu", peeked,
                   (unsigned long long)peek_id, (unsigned long long)id);

    /* The encoder applies the decoder's checks: what decoded must encode. */
    char *once = NULL, *twice = NULL;
    size_t once_len = 0, twice_len = 0;
    st = fr_msg_encode(&m, &once, &once_len);
    FUZZ_CHECK(st == FR_OK, "a decoded %s does not encode: %s", fr_msg_type_name(m.type), fr_last_error());

    fr_msg back;
    st = fr_msg_decode(once, once_len, &back);
    FUZZ_CHECK(st == FR_OK, "a re-encoded %s does not decode: %s", fr_msg_type_name(m.type), fr_last_error());
    FUZZ_CHECK(back.type == m.type, "round trip changed the type");
    st = fr_msg_encode(&back, &twice, &twice_len);
    FUZZ_CHECK(st == FR_OK, "second encode failed: %s", fr_last_error());
    FUZZ_CHECK(once_len == twice_len && memcmp(once, twice, once_len) == 0,
               "%s: encode(decode(encode(m))) differs from encode(m) (%zu vs %zu bytes)",
               fr_msg_type_name(m.type), once_len, twice_len);

    free(once);
    free(twice);
    fr_msg_free(&back);
    fr_msg_free(&m);
    FUZZ_CHECK(m.type == FR_MSG_NONE, "fr_msg_free did not clear the message");
    return 0;
}
