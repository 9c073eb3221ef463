/* The coordinator of `fp4rollout serve` (docs/protocol.md): one ROUTER
 * socket facing the trainers, driving a session's continuous-batching
 * scheduler in a single loop; under mpirun, every rank runs the loop and
 * world rank 0 alone owns the socket (docs/protocol.md, "Serving on several
 * ranks").
 *
 *     fr_bridge_server *srv;
 *     fr_bridge_server_new(&session, &cfg, &srv);   // binds the socket
 *     fr_bridge_server_run(srv, &stop_flag);        // until *stop_flag
 *     fr_bridge_server_destroy(&srv);
 *
 * The loop receives without blocking while the engine has work (and waits
 * on the socket when it has none), steps the scheduler once per turn,
 * streams each step's new tokens to the client that sent the request, and
 * sends one done per sample. Requests are keyed by (client, request_id):
 * two clients may use the same ids, and abort reaches only the sender's
 * requests. Pause, resume, stats and hello are answered in the same loop.
 * Every accepted sample gets exactly one done, shutdown included (reason
 * abort). */
#ifndef FR_BRIDGE_SERVER_H
#define FR_BRIDGE_SERVER_H

#include <signal.h>
#include <stdio.h>

#include "comm/mpi_world.h"
#include "rollout/monitor/metrics_http.h"
#include "trainer_bridge/protocol/protocol.h"
#include "rollout/monitor/recalibrate.h"
#include "rollout/engine/session.h"
#include "tokenizer/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_BRIDGE_MAX_STOP_IDS 64

/* Sampling defaults of generates that leave them out. A generate without
 * a seed takes the next of the server's stream of seeds, which starts from
 * params.seed when has_seed, else from the operating system
 * (docs/sampling.md, "Seeds"). */
typedef struct {
    fr_sampling_params params;     /* temperature, top_k, top_p; seed: see has_seed */
    int has_seed;
    int max_tokens;
    int n_stop;                    /* 0: stop at the model's EOS ids */
    int stop_token_ids[FR_BRIDGE_MAX_STOP_IDS];
} fr_bridge_sampling;

typedef struct {
    const char *endpoint;          /* ZeroMQ endpoint to bind, e.g. "tcp://127.0.0.1:5555" */
    const char *model_name;        /* what hello reports as the model */
    int max_seqs;                  /* the scheduler's sequences at once (0: the cache's slots) */
    int chunk;                     /* tokens per step (0: the session's) */
    fr_bridge_sampling sampling;   /* defaults for what a generate leaves out */
    int shutdown_linger_ms;        /* how long shutdown tries to deliver the last messages */
    double kl_sample_rate;         /* share of samples with a BF16-KV shadow when a generate leaves it open */
    int stats_log_ms;              /* the one-line serving summary every this often; 0: 10 s; < 0: never */
    int update_idle_ms;            /* a staged weight update with no message for this long is dropped; 0: never */
    int nccl_timeout_ms;           /* an NCCL weight group that has work and makes no progress for this long is
                                      aborted (docs/protocol.md, "Weights over NCCL"); 0: 30000 */
    /* CURVE (docs/protocol.md, "Authentication"): the server's secret key in
     * Z85 (40 characters), "" for none; then only clients whose public key
     * is listed may talk to it. */
    const char *curve_secret_key;
    const char *const *curve_client_keys;   /* Z85 public keys */
    int n_curve_client_keys;
    /* Keys with the trainer role (docs/protocol.md, "Roles"): weight updates,
     * pause and resume, NCCL groups; the client keys above have the
     * rollout-client role (generate, abort, stats, hello). None listed: every
     * client key is a trainer. Without CURVE every client is a trainer and
     * the socket must be on loopback. */
    const char *const *curve_trainer_keys;
    int n_curve_trainer_keys;
    /* Connections (docs/protocol.md, "Departed clients"): ZMTP heartbeats
     * every heartbeat_ms (0: 1000; < 0: none), a connection silent for
     * heartbeat_timeout_ms (0: ten intervals) is closed and its client's
     * requests aborted (a client whose receive queue is full reads no
     * heartbeats either); frames over max_message_bytes (0: 1 GiB) make
     * ZeroMQ drop the connection that sent them. */
    int heartbeat_ms;
    int heartbeat_timeout_ms;
    long long max_message_bytes;
    FILE *log;                     /* start, stop and warning lines; NULL: stderr */
    /* The metrics endpoint (rollout/monitor/metrics_http.h: /metrics, /metrics.json,
     * /dashboard) on metrics_bind (NULL: 127.0.0.1): this port, 0 none, -1
     * any free port (fr_bridge_server_metrics_port says which). With
     * metrics_port_fallback a taken port gives way to any free one (logged):
     * the default port of a configuration that names none. */
    int metrics_port;
    int metrics_port_fallback;
    const char *metrics_bind;
    /* 1: no metrics port of the server's own: another HTTP server (the
     * HTTP API) serves the snapshots (fr_bridge_server_metrics) on its
     * port; metrics_port only says whether there are metrics at all */
    int metrics_external;
    /* Its limits (docs/metrics.md, "Limits"): connections at once (0: 64),
     * seconds an idle connection stays (0: 10), and a bearer token (NULL or
     * "": none). With CURVE on and no token it binds 127.0.0.1 whatever
     * metrics_bind says: the figures are then for this host only. */
    int metrics_max_connections;
    int metrics_idle_timeout_s;
    const char *metrics_token;
    /* The same snapshots as msgpack on a ZeroMQ PUB socket bound to this
     * endpoint (trainer_bridge/server/metrics_pub.h); NULL or "": none. */
    const char *metrics_pub_endpoint;
    /* The metrics endpoint's history is also appended to this file (JSON
     * lines, rollout/monitor/metrics_history.h); NULL or "": none. */
    const char *metrics_log;
    /* Automatic recalibration of the key mean (rollout/monitor/recalibrate.h); NULL:
     * off. One rank only (not with world of several ranks). */
    const fr_recal_config *recal;
    /* Several ranks: the MPI world (NULL, or a world of one: one process)
     * and its ranks per engine. Every rank makes its server with the same
     * config and session options (its session on its engine group when tp
     * > 1) and runs it; world rank 0 binds the socket, routes each generate
     * to the engine with the fewest open samples and streams every engine's
     * results. fr_bridge_server_run is then collective over the world. */
    const fr_mpi_world *world;
    int tp;
    /* Text (docs/protocol.md, generate's text keys): the tokenizer that
     * encodes prompt_text and decodes samples for stop strings and
     * return_text, on every rank (NULL: such requests are refused; it must
     * outlive the server), and what hello calls it. */
    const fr_tokenizer *tokenizer;
    const char *tokenizer_name;
} fr_bridge_config;

typedef struct fr_bridge_server fr_bridge_server;

/* Builds the scheduler on the session (which must outlive the server) and
 * binds the socket (rank 0 only with several ranks): FR_EIO naming the
 * endpoint when it cannot bind. Not collective: with several ranks, the
 * caller agrees with fr_mpi_world_all_ok that every rank made its server. */
fr_status fr_bridge_server_new(fr_session *s, const fr_bridge_config *cfg, fr_bridge_server **out);

/* Serves until *stop becomes non-zero (a signal handler sets it; with
 * several ranks, on any rank), then
 * shuts down: requests held by a pause and samples in flight end with done
 * (reason abort), clients waiting for a pause get an error, and the last
 * messages are delivered for up to shutdown_linger_ms. FR_EIO when the
 * socket fails. With several ranks: a failure on any rank (a step of a
 * tensor-parallel engine, out of memory, a weight switch that failed on
 * some ranks only) ends the loop on every rank and every rank returns an
 * error; an MPI failure ends the job (fr_mpi_world_abort). */
fr_status fr_bridge_server_run(fr_bridge_server *srv, const volatile sig_atomic_t *stop);

/* The metrics endpoint's port, -1 when there is none. */
int fr_bridge_server_metrics_port(const fr_bridge_server *srv);

/* 1 when a ZeroMQ endpoint can be reached from this host only (tcp on
 * 127.x.x.x, localhost or [::1]; ipc; inproc): the only endpoints a server
 * without CURVE binds (docs/protocol.md, "Roles"). */
int fr_bridge_endpoint_is_loopback(const char *endpoint);

/* The endpoint the socket is bound to (ZMQ_LAST_ENDPOINT). */
const char *fr_bridge_server_endpoint(const fr_bridge_server *srv);

/* In-process clients: the HTTP API of the same process (trainer_bridge/http/)
 * reaches the engine through the serve loop, as a ZeroMQ client does.
 * fr_bridge_server_local_open (before run; world rank 0 only) makes
 * n_clients clients, each a peer of its own with its own request ids.
 * fr_bridge_server_local_send, from any thread, queues one protocol message
 * (frame 0, msgpack, with payload frames that stay the caller's until the
 * server answered it) from a client with the trainer role or not; the loop
 * handles it as it handles the socket's (docs/protocol.md), and whatever
 * it sends that client reaches sink->on_msg on the loop's thread, in
 * order. fr_bridge_server_local_command queues a command beyond the
 * protocol, run between engine steps and answered once through
 * sink->on_command with a code ("ok", "busy", "failed", "unsupported") and
 * a message. After the loop ends nothing is taken (FR_EIO) and what was
 * queued is dropped unanswered: the client ends its own waits then. */
typedef struct {
    void (*on_msg)(void *user, int client, const fr_msg *m);
    void (*on_command)(void *user, int client, const char *code, const char *message);
    void *user;
} fr_bridge_local_sink;

typedef struct {
    const void *data;
    size_t len;
} fr_bridge_frame;

typedef enum {
    /* frees the KV cache's memory (and with weights the device weights'),
     * kept by an idle engine of one rank; generates are refused
     * (memory_released) until resumed */
    FR_BRIDGE_CMD_RELEASE_MEMORY = 1,
    FR_BRIDGE_CMD_RESUME_MEMORY,
    /* "ok" when the engine is idle (no page is held across requests) */
    FR_BRIDGE_CMD_FLUSH_CACHE,
} fr_bridge_cmd_kind;

typedef struct {
    fr_bridge_cmd_kind kind;
    int weights;   /* RELEASE_MEMORY: the weights' device memory too (CUDA) */
} fr_bridge_cmd;

fr_status fr_bridge_server_local_open(fr_bridge_server *srv, int n_clients, const fr_bridge_local_sink *sink);
fr_status fr_bridge_server_local_send(fr_bridge_server *srv, int client, int trainer, const void *frame0,
                                      size_t len0, const fr_bridge_frame *payload, int n_payload);
fr_status fr_bridge_server_local_command(fr_bridge_server *srv, int client, const fr_bridge_cmd *cmd);

/* The metrics snapshots the server publishes, for an HTTP server that
 * serves /metrics, /health and /dashboard itself (NULL when metrics are
 * off, or the server binds its own metrics port). */
struct fr_metrics_http *fr_bridge_server_metrics(fr_bridge_server *srv);
/* The served model's configuration (vocabulary, BOS and EOS ids). */
const fr_model_config *fr_bridge_server_model_config(const fr_bridge_server *srv);
/* The tokenizer the server encodes and decodes text with (the config's;
 * NULL: none), and what hello calls it in *name (may be NULL). */
const fr_tokenizer *fr_bridge_server_tokenizer(const fr_bridge_server *srv, const char **name);
/* A prompt given as text into ids (*ids malloc'd, *n > 0), exactly as the
 * server encodes a generate's prompt_text (docs/protocol.md, "Text"):
 * add_special puts the tokenizer's special tokens around it. FR_EINVAL
 * when it is not UTF-8, encodes to no token or to more than a generate
 * may hold. */
fr_status fr_bridge_encode_prompt(const fr_tokenizer *tok, const char *text, size_t len, int add_special, int **ids,
                                  int *n);

/* NULL-safe; ends anything still open with reason abort first. */
void fr_bridge_server_destroy(fr_bridge_server **srv);

#ifdef __cplusplus
}
#endif

#endif
