/* The C client of the trainer bridge (libfp4rollout_client; docs/protocol.md).
 * It needs nothing but libzmq, msgpack-c and the protocol codec.
 *
 *     fr_client *c;
 *     fr_client_new("tcp://127.0.0.1:5555", &c);
 *     fr_msg_hello_reply info;
 *     fr_client_hello(c, "my-trainer", &info);
 *     fr_client_generate(c, &request);            // returns at once
 *     while (fr_client_open_samples(c) > 0)
 *         fr_client_dispatch(c, &handlers, 1000, NULL);   // callbacks ...
 *     // ... or poll: fr_client_next(c, 1000, &msg, &got), then fr_msg_free
 *     fr_client_destroy(&c);
 *
 * Results (tokens, done, and errors about a request) arrive asynchronously.
 * The calls answered by a reply (hello, abort, pause, resume, stats, the
 * weight updates) wait for their own reply; whatever else arrives meanwhile
 * is kept for its reader. Results go by request: a reader either names the
 * requests it wants (fr_client_wait_event with ids) or takes those of every
 * request that no reader owns (fr_client_next, fr_client_dispatch,
 * fr_client_next_sample, fr_client_next_event, fr_client_wait_event
 * without ids); a request sent with fr_client_generate_owned goes only to
 * readers that name it. Each result is handed out once, to one reader.
 *
 * Threads: one client may be used by several threads at once. One thread
 * at a time receives from the socket and routes what comes to the request
 * or the call it belongs to; the others wait for theirs. So several
 * threads can each send requests and wait for their own results, and
 * calls from several threads each get their own reply (replies meet calls
 * by type, oldest first; an error that names no request answers the oldest
 * call that can get it). Two weight updates on one client at once are
 * refused. fr_client_next_event's delta and fr_client_last_error are the
 * client's, not the thread's: threads read results with
 * fr_client_wait_event, whose events they own. */
#ifndef FR_CLIENT_H
#define FR_CLIENT_H

#include "trainer_bridge/protocol/protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_client fr_client;

/* Connects a DEALER socket to endpoint (ZeroMQ connects lazily: a server
 * that is not up yet is reached when it is). */
fr_status fr_client_new(const char *endpoint, fr_client **out);
void fr_client_destroy(fr_client **c);

/* CURVE (docs/protocol.md, "Authentication"): the server's public key and
 * this client's key pair, each 40 Z85 characters (fr_client_keypair makes a
 * pair). A server with CURVE on answers only clients whose public key it
 * lists; to any other client it never answers (calls time out). */
typedef struct {
    const char *server_public_key;
    const char *public_key;
    const char *secret_key;
} fr_client_curve;
fr_status fr_client_new_curve(const char *endpoint, const fr_client_curve *keys, fr_client **out);
/* A new CURVE key pair, Z85 with the NUL (41 bytes each). */
fr_status fr_client_keypair(char public_key[41], char secret_key[41]);

/* How long a call waits for its reply, and a send for room, in ms (default
 * 30000; -1: no limit). A pause in mode wait is not limited by it: it lasts
 * as long as the samples in flight (it ends with its reply, or with the
 * connection). Waits for results take their own limits. */
void fr_client_set_timeout(fr_client *c, int timeout_ms);

fr_status fr_client_hello(fr_client *c, const char *name, fr_msg_hello_reply *out);
fr_status fr_client_stats(fr_client *c, fr_msg_stats_reply *out);
/* Pause (docs/protocol.md, "pause"): abort mode ends the samples in
 * flight now (their done messages, reason abort, with what each sample
 * made so far, come first and go to their readers); wait mode returns once
 * the engine has finished them, starting nothing new; keep mode freezes
 * them where they are, KV cache kept, and returns at once: a weight update
 * committed meanwhile draws their next tokens after the resume. */
fr_status fr_client_pause(fr_client *c, fr_pause_mode mode, fr_msg_pause_reply *out);
fr_status fr_client_resume(fr_client *c, fr_msg_resume_reply *out);
/* With recompute (keep mode only): the frozen samples' KV cache is dropped
 * at the pause (freeing its memory for the update) or at the resume, and
 * recomputed with the weights serving when they go on, so their next
 * tokens are exactly those of the new weights. */
fr_status fr_client_pause_ex(fr_client *c, fr_pause_mode mode, int recompute, fr_msg_pause_reply *out);
fr_status fr_client_resume_ex(fr_client *c, int recompute, fr_msg_resume_reply *out);

/* Sends a generate. FR_EINVAL when request_id is already open on this
 * client (ids must be unique among open requests: a request stays open
 * until its last done or its error was handed out, or it was discarded) or
 * the message is invalid; nothing is sent then. A generate with
 * continue_tokens continues a partial sample (fr_client_continue_sample
 * fills one from a sample). */
fr_status fr_client_generate(fr_client *c, const fr_msg_generate *g);
/* fr_client_generate for a reader of its own: the request's results go only
 * to fr_client_wait_event calls that name it, never to the readers of
 * every request, and its samples are not counted by
 * fr_client_open_samples. */
fr_status fr_client_generate_owned(fr_client *c, const fr_msg_generate *g);

/* Aborts the given requests (n >= 1), or every open request of this
 * client (ids NULL, n 0), and waits for the reply: *samples_ended (may be
 * NULL) gets the samples it ended, *not_found (may be NULL) the number of
 * ids the server had no open request for (finished already, or unknown).
 * The done messages of the ended samples (reason abort, with the tokens,
 * log-probs and weight versions made so far) arrive before the reply and
 * wait for their readers like any result. */
fr_status fr_client_abort(fr_client *c, const uint64_t *ids, int n, int *samples_ended, int *not_found);

/* Samples of the requests not owned by a reader whose done has not been
 * handed out yet (a done received but not read still counts; requests the
 * server refused count until their error is read). */
int fr_client_open_samples(const fr_client *c);
/* The same for the requests named (owned or not). */
int fr_client_open_samples_of(fr_client *c, const uint64_t *ids, int n);
/* The requests not owned by a reader with samples open: their count, and
 * the first `cap` ids into ids (may be NULL). */
int fr_client_open_requests(fr_client *c, uint64_t *ids, int cap);
/* Gives requests up on this side: what was received of them and what
 * arrives later is dropped, and they no longer count as open. It does not
 * end them on the server: abort them first (a deadline's way: abort, read
 * what the abort ended, discard the rest). */
fr_status fr_client_discard(fr_client *c, const uint64_t *ids, int n);

/* A lost server (docs/failures.md). The client sends ZMTP heartbeats and
 * watches its connection: when it ends (the server was killed, or was
 * silent for 3 s) with samples open, the readers of those samples return
 * FR_EIO, once what arrived before is read, with a message naming the
 * requests whose samples will not end; fr_client_lost is then 1, and a
 * call waiting for its reply fails. Only requests sent on the connection
 * that ended are lost: later ones (to a restarted server) go on.
 * fr_client_resubmit sends every lost request again, with its own request
 * id (to a restarted server: request ids make it idempotent, as a server
 * that still has the request refuses the copy with duplicate_request_id),
 * drops what was streamed of it, and clears its lost state; *n_requests
 * gets how many it sent. An unseeded request gets a new seed from the new
 * server. fr_client_lost is 1 while a lost request has samples to come. */
int fr_client_lost(const fr_client *c);
fr_status fr_client_resubmit(fr_client *c, int *n_requests);

/* Polling: the next tokens, done or error message of the requests not
 * owned by a reader (or a reply no call waits for), waiting up to
 * timeout_ms (0: do not wait, -1: forever). *got 0 when none came. The
 * caller frees *out with fr_msg_free. */
fr_status fr_client_next(fr_client *c, int timeout_ms, fr_msg *out, int *got);

/* ---- weight updates ---- */

/* One tensor of a weight update, in the caller's memory: row-major,
 * little-endian, fr_msg_tensor_bytes bytes (dtype size x the shape's
 * elements). The client sends it without copying: it must stay valid and
 * unchanged until fr_client_update_weights returns. */
typedef struct {
    const char *name;              /* Hugging Face name, < 256 bytes */
    fr_dtype dtype;
    int ndim;                      /* 1 to FR_PROTO_MAX_NDIM */
    const int64_t *shape;
    const void *data;
} fr_client_tensor;

#define FR_CLIENT_BUCKET_BYTES (512ull << 20)   /* default bucket size: 512 MiB */

typedef struct {
    uint64_t bucket_bytes;         /* payload bytes per bucket; 0: FR_CLIENT_BUCKET_BYTES */
    /* For testing servers: send bucket number corrupt_bucket with a wrong
     * checksum (-1: none). */
    int corrupt_bucket;
    /* 1: a partial update: only these tensors change, the model's others
     * keep their serving values (docs/protocol.md, update_weights_begin's
     * partial); 0: the tensors must be every weight of the model. */
    int partial;
} fr_client_update_opts;

/* Sends the tensors as weight version `version` (greater than the server's):
 * update_weights_begin, the buckets (each with its xxHash64, the tensors'
 * bytes as zero-copy payload frames, one reply each, two buckets in flight
 * so the server stages one while the next travels), then
 * update_weights_commit; returns once the server has switched to the new
 * weights (*out, may be NULL: the commit reply). A refusal by the server
 * fails with the server's code and message (fr_client_last_error tells them
 * apart); the server then keeps serving its old version. opts may be NULL. */
fr_status fr_client_update_weights(fr_client *c, const fr_client_tensor *tensors, int n, uint64_t version,
                                   const fr_client_update_opts *opts, fr_msg_update_reply *out);

/* ---- weights over NCCL (docs/protocol.md, "Weights over NCCL") ---- */

/* Makes an NCCL group with the server for weight updates, this process as
 * rank 0 on CUDA device cuda_device (made current for the calling thread),
 * and returns once every member joined (within the client's timeout). The
 * group lives until fr_client_nccl_group_close, fr_client_destroy, or a
 * failure of an update over it. The group holds this client (rank 0, the
 * sender) and every rank of the server: a server of several ranks (tensor
 * parallel, several engines) has each of them join, and each bucket reaches
 * all of them in one broadcast. FR_EUNSUPPORTED when this library was built
 * without CUDA or the device is missing (nothing is sent then); a server
 * that cannot join (CPU backend, built without CUDA) refuses with code
 * nccl_unavailable (fr_client_last_error). */
fr_status fr_client_nccl_group_init(fr_client *c, int cuda_device);
/* The members of the client's NCCL weight group (1 + the server's ranks),
 * 0 when it has none. */
int fr_client_nccl_group_size(fr_client *c);
/* Ends the group on both sides (best effort on the server's); NULL-safe on
 * a client without one. */
fr_status fr_client_nccl_group_close(fr_client *c);

/* fr_client_update_weights over the NCCL group: the tensors' data are
 * DEVICE pointers on the group's device, read on the caller's CUDA stream
 * `stream` (a cudaStream_t; NULL: the legacy default stream) after the work
 * already queued on it, so a PyTorch tensor's pending writes are seen and
 * nothing is copied to the host. The tensors are packed into two device
 * buckets of opts->bucket_bytes (default FR_CLIENT_BUCKET_BYTES) in turn:
 * packing bucket k + 1 overlaps broadcasting bucket k. Returns once the
 * server committed (*out: the commit reply) or refused (its code and
 * message, as fr_client_update_weights). Any failure after the begin also
 * ends the group (make a new one); the server keeps serving its old
 * weights. opts->corrupt_bucket sends a wrong checksum for that bucket
 * (testing). */
fr_status fr_client_update_weights_nccl(fr_client *c, const fr_client_tensor *tensors, int n, uint64_t version,
                                        void *stream, const fr_client_update_opts *opts, fr_msg_update_reply *out);

/* The server's own account of the calling thread's last failure, when
 * that failure was a server's error (in answer to a call, or about a
 * request): 1 and its code, message and request id (-1 when none) through
 * the non-NULL pointers; 0 when the last failure was not the server's (or c
 * is NULL). A thin alias of the project's one error store
 * (fr_last_error_peer, base/fr_status.h), kept for bindings: the strings
 * live until the thread's next failure. */
int fr_client_last_error(const fr_client *c, const char **code, const char **message, long long *request_id);

/* ---- finished samples (for bindings and simple loops) ---- */

/* One sample assembled from its token deltas and its done. */
typedef struct {
    uint64_t request_id, group_id;
    int sample;
    int start;                     /* a continuation: token_ids[0] is token `start` of the whole sample */
    int n_tokens;
    int *token_ids;                /* [n_tokens] */
    float *logprobs;               /* [n_tokens] */
    uint64_t *weight_versions;     /* [n_tokens] */
    char finish_reason[8];         /* stop, length, abort, error */
    int n_prompt, preemptions;
    int has_ttft;
    double ttft_ms, total_ms;
    fr_msg_divergence divergence;  /* kl: per-token KL when asked for */
    int has_seed;                  /* 0: the server did not report the seed */
    uint64_t seed;                 /* the seed that produced it: replays it (docs/sampling.md) */
    /* Asked for with the generate's logprobs (k) and prompt_logprobs. */
    int top_k;                     /* 0: none */
    int *top_token_ids;            /* [n_tokens * top_k]: token i's k most likely, best first */
    float *top_logprobs;           /* [n_tokens * top_k] */
    float *prompt_logprobs;        /* prompt tokens 1 .. n_prompt - 1 (the request's first sample); NULL: none */
    int n_prompt_logprobs;
    /* Asked for with the generate's return_text (the server's tokenizer). */
    int has_text;
    char *text;                    /* the whole text (text_len bytes, NUL-terminated) */
    size_t text_len;
    char *stop_str;                /* the stop string that ended it; NULL: none did */
    int *prompt_token_ids;         /* [n_prompt]: the ids a prompt_text became; NULL otherwise */
    int n_prompt_token_ids;
    /* Asked for with the generate's return_routed_experts (a model with
     * MoE layers): token i's route_layers x route_k expert ids, each
     * route_width bytes (1, or 2 little endian), at routed_experts + i *
     * route_layers * route_k * route_width; NULL: none. */
    uint8_t *routed_experts;
    int route_layers, route_k, route_width;
} fr_client_sample;

/* Reads the results of the requests not owned by a reader until a sample
 * ends: 1 in *got and the sample (free with fr_client_sample_free), or *got
 * 0 when nothing ended within timeout_ms (at once when no such sample is
 * open). An error about a request (a refused generate) fails with
 * FR_EINVAL and its message (fr_client_last_error has the code and the
 * request id). Assembles deltas that fr_client_next would hand out raw: do
 * not mix the two on the same requests. */
fr_status fr_client_next_sample(fr_client *c, int timeout_ms, fr_client_sample **out, int *got);
void fr_client_sample_free(fr_client_sample **s);

/* The generate that continues sample s of request g (docs/sampling.md,
 * "Continuing a sample"), e.g. one an abort or a pause with mode abort
 * ended: g's prompt and sampling parameters (max_tokens counting the whole
 * sample), s's seed and index (first_sample, n 1), its group, and as
 * continue_tokens every token the sample made so far (g's own
 * continue_tokens, then s's). out becomes a FR_MSG_GENERATE message with
 * request_id that owns its arrays: send out->u.generate, then fr_msg_free.
 * The continuation's sample holds the new tokens, from token `start` =
 * the continued count; in deterministic mode they are bitwise those the
 * sample would have made uninterrupted. */
fr_status fr_client_continuation(const fr_msg_generate *g, const fr_client_sample *s, uint64_t request_id,
                                 fr_msg *out);

/* A token delta as it arrives (docs/protocol.md, "tokens"): tokens start
 * .. start + n - 1 of one sample. The arrays belong to the client and stay
 * valid until its next call. */
typedef struct {
    uint64_t request_id;
    int sample, start, n;
    const int *token_ids;
    const float *logprobs;
    const uint64_t *weight_versions;
    int has_text;                  /* the generate asked for return_text */
    const char *text;              /* the text these tokens made final: text_len bytes (maybe 0), never half a
                                      character nor the start of a stop string that may yet match */
    size_t text_len;
} fr_client_delta;

/* fr_client_next_sample that also hands out every token delta as it
 * arrives, for streaming: *got 1 with *delta, 2 with *out (a finished
 * sample, as fr_client_next_sample gives it; its tokens are the deltas'
 * concatenated), 0 when nothing came within timeout_ms. Do not mix with
 * fr_client_next. */
fr_status fr_client_next_event(fr_client *c, int timeout_ms, fr_client_delta *delta, fr_client_sample **out,
                               int *got);

/* What fr_client_wait_event hands out; it owns what it points to until
 * fr_client_event_free. */
typedef enum {
    FR_CLIENT_EVENT_NONE = 0,     /* nothing within the time, or nothing more can come */
    FR_CLIENT_EVENT_DELTA,        /* delta: a sample's new tokens */
    FR_CLIENT_EVENT_SAMPLE,       /* sample: a finished sample (any reason: abort keeps its tokens) */
    FR_CLIENT_EVENT_ERROR         /* code, message: the server refused request request_id */
} fr_client_event_kind;

typedef struct {
    int kind;                           /* fr_client_event_kind */
    uint64_t request_id;                /* the request it is about */
    fr_client_delta delta;              /* DELTA */
    fr_client_sample *sample;           /* SAMPLE */
    char code[FR_PROTO_NAME_MAX];       /* ERROR: the server's code (invalid_request, ...) */
    char message[FR_PROTO_TEXT_MAX];    /* ERROR: its message, naming the request */
    void *msg_;                         /* (what the delta's arrays live in) */
} fr_client_event;

/* The next event of the requests named (ids, n >= 1), or of every request
 * not owned by a reader (ids NULL, n 0), waiting up to timeout_ms (0: what
 * is there; -1: no limit). With deltas 0, token deltas are only assembled
 * into their samples, not handed out. Returns at once with kind NONE when
 * none of those requests has a sample open. FR_EIO when the connection is
 * lost with samples of theirs still to come (fr_client_lost). Several
 * threads may wait at once, each for its own requests. Free the event with
 * fr_client_event_free. */
fr_status fr_client_wait_event(fr_client *c, const uint64_t *ids, int n, int deltas, int timeout_ms,
                               fr_client_event *ev);
void fr_client_event_free(fr_client_event *ev);

/* ---- JSON (for command lines and bindings) ---- */

/* A reply (hello_reply, stats_reply, pause_reply, resume_reply,
 * abort_reply, update_weights_reply, error) as one JSON object with the
 * keys of docs/protocol.md and "type"; *json is malloc'ed: free it with
 * fr_client_free_string. */
fr_status fr_msg_to_json(const fr_msg *m, char **json);
fr_status fr_client_hello_json(fr_client *c, const char *name, char **json);
fr_status fr_client_stats_json(fr_client *c, char **json);
fr_status fr_client_pause_json(fr_client *c, fr_pause_mode mode, char **json);
fr_status fr_client_resume_json(fr_client *c, char **json);
fr_status fr_client_pause_ex_json(fr_client *c, fr_pause_mode mode, int recompute, char **json);
fr_status fr_client_resume_ex_json(fr_client *c, int recompute, char **json);
fr_status fr_client_abort_json(fr_client *c, const uint64_t *ids, int n, char **json);
void fr_client_free_string(char *s);
/* One whole msgpack value (maps with string keys, arrays, numbers, strings,
 * booleans, nil) as JSON; NaN and infinities become null. */
fr_status fr_msgpack_to_json(const void *data, size_t len, char **json);

/* The last error message of the calling thread (fr_last_error, the one
 * error store), for bindings that cannot reach the status module. */
const char *fr_client_error_text(void);

/* Sends bytes as frame 0, unchecked, followed by extra_frames empty
 * frames: for testing how a server handles malformed messages. */
fr_status fr_client_send_raw(fr_client *c, const void *data, size_t len, int extra_frames);

typedef struct {
    void (*on_tokens)(void *user, const fr_msg_tokens *t);
    void (*on_done)(void *user, const fr_msg_done *d);
    void (*on_error)(void *user, const fr_msg_error *e);   /* errors about requests */
    void *user;
} fr_client_handlers;

/* Callbacks: hands every message fr_client_next would give that is ready
 * to its handler (a NULL handler skips it); waits up to timeout_ms for the
 * first one. *handled (may be NULL) gets the count. Callbacks run without
 * the client's lock: they may call any function of the client. */
fr_status fr_client_dispatch(fr_client *c, const fr_client_handlers *h, int timeout_ms, int *handled);

#ifdef __cplusplus
}
#endif

#endif
