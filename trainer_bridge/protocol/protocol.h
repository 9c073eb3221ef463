/* The trainer bridge's wire protocol, version 1 (docs/protocol.md): one C
 * struct per message type and the codec between those structs and frame 0
 * of a ZeroMQ message (a msgpack map).
 *
 * Decoding is strict: a frame that is not one msgpack map, a missing or
 * unknown key, a value of the wrong msgpack type or out of range, or an
 * unknown "type" or protocol version fails with FR_EFORMAT (FR_EUNSUPPORTED
 * for another protocol version) and a message that names the key. Nothing
 * is read past the frame, and nothing aborts.
 *
 * Ownership: a decoded message owns its arrays (malloc'ed); free them with
 * fr_msg_free. A message built by hand for fr_msg_encode may point at the
 * caller's arrays; the encoder only reads them (do not fr_msg_free it). */
#ifndef FR_PROTOCOL_H
#define FR_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_PROTO_VERSION 1
#define FR_PROTO_NAME_MAX 256      /* strings of a message: bytes, with the NUL */
#define FR_PROTO_TEXT_MAX 1024     /* error messages, with the NUL */
#define FR_PROTO_MAX_EOS 64        /* eos_token_ids of a hello_reply */
#define FR_PROTO_MAX_ARRAY (1 << 24) /* elements of any array */
#define FR_PROTO_MAX_NDIM 8        /* dimensions of a tensor shape */
#define FR_PROTO_MAX_TENSORS 65536 /* tensors of one weight update */
#define FR_PROTO_NCCL_ID_BYTES 128 /* an NCCL unique id (ncclUniqueId) */
#define FR_PROTO_MAX_LOGPROBS 20   /* top log-probs per generated token (generate's "logprobs") */
#define FR_PROTO_MAX_TEXT (1 << 24) /* bytes of a generate's prompt_text */
#define FR_PROTO_MAX_STOP 32       /* stop strings of a generate */
#define FR_PROTO_MAX_STOP_BYTES 1024 /* bytes of one stop string */
#define FR_PROTO_MAX_ROUTE_DIM 65536 /* layers, and experts per token, of routed experts */

typedef enum {
    FR_MSG_NONE = 0,
    /* client -> server */
    FR_MSG_HELLO,
    FR_MSG_GENERATE,
    FR_MSG_ABORT,
    FR_MSG_PAUSE,
    FR_MSG_RESUME,
    FR_MSG_STATS,
    FR_MSG_UPDATE_BEGIN,
    FR_MSG_UPDATE_BUCKET,
    FR_MSG_UPDATE_COMMIT,
    FR_MSG_UPDATE_ABORT,
    FR_MSG_NCCL_INIT,
    FR_MSG_NCCL_BUCKET,
    FR_MSG_NCCL_CLOSE,
    /* server -> client */
    FR_MSG_HELLO_REPLY,
    FR_MSG_TOKENS,
    FR_MSG_DONE,
    FR_MSG_ABORT_REPLY,
    FR_MSG_PAUSE_REPLY,
    FR_MSG_RESUME_REPLY,
    FR_MSG_STATS_REPLY,
    FR_MSG_ERROR,
    FR_MSG_UPDATE_REPLY,
    FR_MSG_NCCL_REPLY,
    FR_MSG_TYPE_COUNT
} fr_msg_type;

/* The wire name of a type ("generate", "tokens", ...); "none" for others. */
const char *fr_msg_type_name(fr_msg_type t);
/* 1 for the types a client sends, 0 otherwise. */
int fr_msg_type_from_client(fr_msg_type t);

typedef enum { FR_PAUSE_ABORT = 0, FR_PAUSE_WAIT, FR_PAUSE_KEEP } fr_pause_mode;
const char *fr_pause_mode_name(fr_pause_mode m);   /* "abort", "wait", "keep" */

/* Finish reasons on the wire: "stop", "length", "abort", "error". */
typedef enum { FR_WIRE_STOP = 0, FR_WIRE_LENGTH, FR_WIRE_ABORT, FR_WIRE_ERROR } fr_wire_finish;
const char *fr_wire_finish_name(fr_wire_finish f);

/* Frame 0 of every metrics snapshot on the PUB socket (docs/metrics.md,
 * "PUB socket"); frame 1 is its msgpack. */
#define FR_METRICS_TOPIC "fp4rollout.metrics"

/* Tensor dtypes of a weight update are base/dtype.h's weight types, named
 * "f32", "bf16", "f16" on the wire; little-endian, row-major, unpadded. */

typedef struct {
    char client[FR_PROTO_NAME_MAX];      /* optional free-form name, "" when absent */
} fr_msg_hello;

/* A tensor as a weight update names it: Hugging Face name, dtype, shape. */
typedef struct {
    char name[FR_PROTO_NAME_MAX];
    fr_dtype dtype;
    int ndim;                            /* 1 to FR_PROTO_MAX_NDIM */
    int64_t shape[FR_PROTO_MAX_NDIM];    /* each >= 1 */
} fr_msg_tensor;

/* Elements and bytes of a tensor (0 when the shape overflows 2^62). */
uint64_t fr_msg_tensor_bytes(const fr_msg_tensor *t);

/* update_weights_begin: the tensors to come, in all total_bytes bytes, sent
 * in buckets of at most bucket_bytes payload bytes. */
typedef struct {
    uint64_t version;                    /* > the server's weight version */
    fr_msg_tensor *tensors;              /* [n_tensors], 1 to FR_PROTO_MAX_TENSORS, names distinct */
    int n_tensors;
    uint64_t total_bytes;                /* the sum of the tensors' bytes */
    uint64_t bucket_bytes;               /* >= 1 */
    int nccl;                            /* transport: 0 "zmq" (absent), 1 "nccl" (the buckets are broadcast
                                            over the client's NCCL group: update_weights_nccl_bucket) */
    int partial;                         /* 1: only the tensors listed change; the model's others keep
                                            their serving values (absent: 0, every tensor must be sent) */
} fr_msg_update_begin;

/* One piece of a tensor in a bucket: bytes [offset, offset + nbytes) of
 * its row-major data, carried whole by one payload frame. */
typedef struct {
    fr_msg_tensor t;
    uint64_t offset;                     /* a multiple of the element size */
    uint64_t nbytes;                     /* >= 1, a multiple of the element size */
    uint64_t at;                         /* update_weights_nccl_bucket only: where the piece starts in
                                            the broadcast bucket (a multiple of the element size) */
} fr_msg_piece;

/* update_weights_bucket: pieces[i] is payload frame i + 1; xxh64 is the
 * xxHash64 (seed 0) of the payload frames' bytes, concatenated in order. */
typedef struct {
    uint64_t version;
    int bucket;                          /* 0, 1, ... in order */
    uint64_t xxh64;
    fr_msg_piece *pieces;                /* [n_pieces], >= 1 */
    int n_pieces;
} fr_msg_update_bucket;

/* update_weights_nccl_bucket: bucket `bucket` of an update begun with
 * transport nccl. Its nbytes bytes follow as one ncclBroadcast from the
 * client (NCCL rank 0) over the group; pieces[i] lies at bytes [at, at +
 * nbytes) of them. checksum is the chunked xxHash64 of the broadcast bytes
 * (comm/dev_checksum.h). */
typedef struct {
    uint64_t version;
    int bucket;                          /* 0, 1, ... in order */
    uint64_t nbytes;                     /* bytes broadcast, >= 1 */
    uint64_t checksum;
    fr_msg_piece *pieces;                /* [n_pieces], >= 1, inside [0, nbytes), not overlapping */
    int n_pieces;
} fr_msg_nccl_bucket;

/* nccl_group_init: the client made an NCCL unique id and is rank 0 of a
 * group the serving ranks join (docs/protocol.md, "Weights over NCCL"). */
typedef struct {
    unsigned char unique_id[FR_PROTO_NCCL_ID_BYTES];
} fr_msg_nccl_init;

/* nccl_group_reply: the answer to nccl_group_init (state joining: the
 * group's size and the client's rank in it) and to nccl_group_close (state
 * closed, nranks and rank 0). */
typedef enum { FR_NCCL_JOINING = 0, FR_NCCL_CLOSED } fr_nccl_state;
const char *fr_nccl_state_name(fr_nccl_state s);   /* "joining", "closed" */

typedef struct {
    fr_nccl_state state;
    int nranks;                          /* joining: >= 2 */
    int rank;                            /* joining: the client's rank, 0 */
    double timeout_s;                    /* how long the server waits on the group without progress */
} fr_msg_nccl_reply;

/* update_weights_commit and update_weights_abort. */
typedef struct {
    uint64_t version;
} fr_msg_update_end;

/* What an update_weights_reply answers. */
typedef enum { FR_UPD_BEGIN = 0, FR_UPD_BUCKET, FR_UPD_COMMIT, FR_UPD_ABORT } fr_update_stage;
const char *fr_update_stage_name(fr_update_stage s);   /* "begin", "bucket", "commit", "abort" */

typedef struct {
    uint64_t version;
    fr_update_stage stage;
    int bucket;                          /* the bucket answered (stage bucket), else -1 (nil) */
    uint64_t bytes;                      /* payload bytes staged so far */
    uint64_t weight_version;             /* the version serving now (the new one after a commit) */
} fr_msg_update_reply;

/* A generate request. Each has_* flag says whether the field is present;
 * an absent sampling field takes the server's default. */
typedef struct {
    uint64_t request_id;                 /* the caller's id, unique among its open requests */
    int has_group_id;
    uint64_t group_id;
    int *prompt;                         /* token ids, >= 0 */
    int n_prompt;                        /* >= 1 */
    int n;                               /* samples, >= 1 (1 when absent) */
    int first_sample;                    /* index of the first sample, >= 0 (0 when absent; sent when > 0) */
    int has_temperature, has_top_k, has_top_p, has_max_tokens, has_stop_token_ids, has_seed;
    double temperature;                  /* >= 0, 0 = greedy */
    int top_k;                           /* >= 0, 0 = off */
    double top_p;                        /* (0, 1] */
    int max_tokens;                      /* >= 1 */
    int *stop_token_ids;                 /* ids >= 0 */
    int n_stop_token_ids;
    uint64_t seed;
    int monitor_divergence;              /* 1, 0, or -1 when absent: the server's kl_sample_rate decides */
    int per_token_kl;                    /* 0 or 1: the done carries every token's KL */
    int *forced_tokens;                  /* teacher forcing: the tokens the samples emit; NULL when absent */
    int n_forced_tokens;                 /* 1 .. FR_PROTO_MAX_ARRAY when present */
    int min_tokens;                      /* >= 0 (0 when absent): stop tokens barred before this many tokens */
    int logprobs;                        /* 0 .. FR_PROTO_MAX_LOGPROBS (0 when absent): top log-probs per token */
    int prompt_logprobs;                 /* 0 or 1: the first sample's done carries the prompt's log-probs */
    /* min_p and penalties (docs/sampling.md, "Penalties and min_p"); 0 when
     * absent (off), sent when not 0 */
    double min_p;                        /* [0, 1] */
    double presence_penalty;             /* [-2, 2] */
    double frequency_penalty;            /* [-2, 2] */
    double repetition_penalty;           /* (0, 2] when sent; 0 absent (off, as 1) */
    int *continue_tokens;                /* a partial sample's tokens to continue from (n 1); NULL when absent */
    int n_continue_tokens;               /* sent when > 0 */
    /* Text (the server's tokenizer; docs/protocol.md, generate): the prompt
     * as UTF-8 text instead of prompt's ids (exactly one of the two is
     * given; NULL when absent), 1 .. FR_PROTO_MAX_TEXT bytes, NUL allowed;
     * add_special_tokens with it: the tokenizer's special tokens around it
     * (a beginning-of-sequence token), 1 when absent. */
    char *prompt_text;
    size_t prompt_text_len;
    int has_add_special_tokens, add_special_tokens;
    /* Stop strings (NULL when absent): n_stop of them, 1 .. FR_PROTO_MAX_STOP,
     * each 1 .. FR_PROTO_MAX_STOP_BYTES bytes of UTF-8 without NUL;
     * include_stop_str_in_output keeps the matched one in the text. */
    char **stop;
    int n_stop;
    int include_stop_str_in_output;      /* 0 or 1 */
    int return_text;                     /* 0 or 1: the tokens deltas and the done carry text */
    int return_routed_experts;           /* 0 or 1: each done carries its tokens' routed experts */
    int keep_special_tokens;             /* 0 or 1: the text holds the special tokens (wire: skip_special_tokens false) */
} fr_msg_generate;

typedef struct {
    int all;                             /* 1: every open request of the sender */
    uint64_t *request_ids;               /* when all is 0: at least one id */
    int n_request_ids;
} fr_msg_abort;

typedef struct {
    fr_pause_mode mode;
    int recompute;                       /* mode keep: drop the frozen samples' KV now; recomputed at resume */
} fr_msg_pause;

typedef struct {
    int recompute;                       /* recompute the KV of the samples a keep pause froze */
} fr_msg_resume;

typedef struct {
    char server[FR_PROTO_NAME_MAX];      /* "fp4rollout" */
    char model[FR_PROTO_NAME_MAX];
    char backend[FR_PROTO_NAME_MAX];     /* "cpu", "cuda" */
    char kv_dtype[FR_PROTO_NAME_MAX];
    int tp, engines;
    uint64_t weight_version;
    int max_seqs;                        /* sequences an engine runs at once */
    int kv_blocks, kv_block_tokens;      /* KV pages per engine, tokens per page */
    int max_model_len;                   /* prompt + generated tokens of one sample */
    int vocab_size;
    int eos_token_ids[FR_PROTO_MAX_EOS];
    int n_eos_token_ids;
    int chunk;                           /* tokens per engine step */
    char tokenizer[FR_PROTO_NAME_MAX];   /* what turns text into ids on the server; "" (absent): none,
                                            so generates with text are refused */
} fr_msg_hello_reply;

/* A streamed delta: tokens start .. start + n - 1 of one sample. */
typedef struct {
    uint64_t request_id;
    int sample;
    int start;
    int n;                               /* >= 1 */
    int *token_ids;                      /* [n] */
    float *logprobs;                     /* [n] */
    uint64_t *weight_versions;           /* [n] */
    int has_text;                        /* the generate asked for return_text */
    char *text;                          /* the text these tokens made final (text_len bytes, maybe 0) */
    size_t text_len;
} fr_msg_tokens;

/* The divergence summary of a monitored sample; has_values 0: every field
 * is nil on the wire (no monitoring, or not monitored). */
typedef struct {
    int has_values;
    double kl_mean, kl_max, top1_agreement, logprob_diff_mean;
    int positions;
    float *kl;                           /* per-token KL (nats) when asked for, else NULL */
    int n_kl;
} fr_msg_divergence;

typedef struct {
    uint64_t request_id, group_id;
    int sample;
    fr_wire_finish finish_reason;
    int start;                           /* a continuation: the tokens it continued (its first token's index) */
    int n_tokens;                        /* tokens streamed for the sample, in all */
    int n_prompt;
    int preemptions;
    int has_ttft;                        /* 0 when no token was produced */
    double ttft_ms;                      /* request received -> first token */
    double total_ms;                     /* request received -> done */
    fr_msg_divergence divergence;
    int has_seed;                        /* 0: a server that does not report it */
    uint64_t seed;                       /* the sampling seed of the sample's request */
    int top_k;                           /* > 0: top log-probs of every token (the generate's logprobs) */
    int *top_token_ids;                  /* [n_tokens * top_k], token i's best first */
    float *top_logprobs;                 /* [n_tokens * top_k] */
    float *prompt_logprobs;              /* log-probs of prompt tokens 1 .. n_prompt - 1; NULL when absent */
    int n_prompt_logprobs;
    int has_text;                        /* the generate asked for return_text */
    char *text;                          /* the sample's whole text (text_len bytes) */
    size_t text_len;
    char *stop_str;                      /* the stop string that ended the sample; NULL: none did */
    int *prompt_token_ids;               /* [n_prompt] the prompt's ids, when it came as prompt_text; else NULL */
    int n_prompt_token_ids;
    /* Routed experts (the generate asked for return_routed_experts; NULL
     * when absent): token i's route_layers x route_k expert ids, each
     * route_width bytes (1: "u8", 2: "u16", little endian), at
     * routed_experts + i * route_layers * route_k * route_width, for the
     * n_tokens tokens of this done (docs/protocol.md, done). */
    uint8_t *routed_experts;
    int route_layers, route_k, route_width;
} fr_msg_done;

typedef struct {
    int samples;                         /* samples ended with reason abort */
    uint64_t *not_found;                 /* ids with no open request of the sender */
    int n_not_found;
} fr_msg_abort_reply;

typedef struct {
    fr_pause_mode mode;
    int aborted;                         /* samples this pause ended with reason abort */
} fr_msg_pause_reply;

typedef struct {
    int released;                        /* requests held during the pause, now submitted */
} fr_msg_resume_reply;

typedef struct {
    /* the engine's scheduler (rollout/engine/scheduler.h) */
    int running, prefilling, waiting;
    uint64_t preemptions, tokens_generated, prefill_tokens, steps, finished;
    int kv_blocks_used, kv_blocks_free;
    /* the server */
    char state[FR_PROTO_NAME_MAX];       /* "running", "pausing", "paused" */
    uint64_t weight_version;
    int clients, open_requests, held_requests;
    uint64_t messages_in, messages_out, bad_messages, errors_sent;
    uint64_t requests_accepted, requests_rejected, samples_done, tokens_streamed;
    uint64_t send_retries, queued_messages, undeliverable_messages;
    uint64_t clients_departed;           /* optional key: connections that ended (0 from older servers) */
    int updating;                        /* 1 while a weight update is staged */
    uint64_t update_version;             /* its version (0 when none) */
    uint64_t updates_committed, updates_failed;
} fr_msg_stats_reply;

typedef struct {
    char code[FR_PROTO_NAME_MAX];        /* bad_message, invalid_request, ... (docs/protocol.md) */
    char message[FR_PROTO_TEXT_MAX];
    int has_request_id;
    uint64_t request_id;
} fr_msg_error;

typedef struct {
    fr_msg_type type;
    union {
        fr_msg_hello hello;
        fr_msg_generate generate;
        fr_msg_abort abort;
        fr_msg_pause pause;
        fr_msg_resume resume;
        fr_msg_hello_reply hello_reply;
        fr_msg_tokens tokens;
        fr_msg_done done;
        fr_msg_abort_reply abort_reply;
        fr_msg_pause_reply pause_reply;
        fr_msg_resume_reply resume_reply;
        fr_msg_stats_reply stats_reply;
        fr_msg_error error;
        fr_msg_update_begin update_begin;
        fr_msg_update_bucket update_bucket;
        fr_msg_update_end update_end;    /* commit and abort */
        fr_msg_update_reply update_reply;
        fr_msg_nccl_init nccl_init;
        fr_msg_nccl_bucket nccl_bucket;
        fr_msg_nccl_reply nccl_reply;
    } u;
} fr_msg;

/* Clears m to type t with every field zero (a generate gets n = 1). */
void fr_msg_init(fr_msg *m, fr_msg_type t);
/* Frees the arrays of a decoded message and clears it; NULL-safe. */
void fr_msg_free(fr_msg *m);

/* Encodes m into a new buffer (*data, *len; free with free()). Checks the
 * message first (the checks of decoding), so it never writes a message that
 * the peer would refuse for its form. */
fr_status fr_msg_encode(const fr_msg *m, char **data, size_t *len);

/* Decodes frame 0. On failure *out is cleared (type FR_MSG_NONE) and
 * nothing needs freeing. */
fr_status fr_msg_decode(const void *data, size_t len, fr_msg *out);

/* Strings on the wire are UTF-8 (docs/protocol.md, "Strings").
 * fr_utf8_valid: 1 when data[0, n) is well-formed UTF-8 (RFC 3629).
 * fr_utf8_escape: data[0, n) as text into out (cap bytes, NUL-terminated),
 * every byte that starts no well-formed sequence, and NUL, written as
 * \xNN; stops at a whole character when out is full. Returns the length
 * written. The result is valid UTF-8 whatever the input. */
int fr_utf8_valid(const void *data, size_t n);
size_t fr_utf8_escape(const void *data, size_t n, char *out, size_t cap);

/* Before anything is unpacked: 0 when frame 0 declares no array longer than
 * max_array entries (and no string or container far beyond its bytes),
 * else FR_EFORMAT saying what it declares. The decoder allocates per
 * declared element, so a server passes the longest array a legal message
 * can hold (the model's window, say) to refuse huge prompts cheaply. */
fr_status fr_msg_check_bounds(const void *data, size_t len, uint64_t max_array);

/* Best effort on a frame that may fail fr_msg_decode: 1 and *id when the
 * frame is a map holding a non-negative integer "request_id", else 0. Lets
 * an error reply name the request a malformed message meant. */
int fr_msg_peek_request_id(const void *data, size_t len, uint64_t *id);

/* Best effort, like fr_msg_peek_request_id: the message type a frame names
 * (FR_MSG_NONE when it names none or an unknown one). Lets the server
 * refuse a server-to-client type before reading its body. */
fr_msg_type fr_msg_peek_type(const void *data, size_t len);

#ifdef __cplusplus
}
#endif

#endif
