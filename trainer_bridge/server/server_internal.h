/* What the files of the coordinator share (trainer_bridge/server/server.h):
 * the server's state and the functions one concern calls in another. Private
 * to trainer_bridge/server/; the public interface is server.h. Functions
 * here take the srv_ prefix: they are visible to the whole library. */
#ifndef FR_SERVER_INTERNAL_H
#define FR_SERVER_INTERNAL_H

#include "trainer_bridge/server/server.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "base/clock.h"
#include "base/seed.h"
#include "comm/rank_wire.h"
#include "rollout/engine/scheduler.h"
#include "rollout/monitor/metrics_http.h"
#include "trainer_bridge/protocol/protocol.h"
#include "trainer_bridge/protocol/wire.h"
#include "trainer_bridge/server/metrics_pub.h"
#include "trainer_bridge/server/peers.h"
#include "trainer_bridge/server/update.h"
#include "rollout/engine/weight_recv.h"
#include "rollout/engine/weight_update.h"
#include "rollout/engine/weight_wire.h"

enum { RUNNING = 0, PAUSING, PAUSED };

typedef struct srv_local srv_local;   /* in-process clients (server_local.c) */

/* A sample's tokens drawn since its last delta went out. */
typedef struct {
    int *tok;
    float *lp;
    uint64_t *wv;            /* the weight version each pending token was drawn with */
    int n_pending, cap;
    int sent;                /* tokens streamed so far: the next delta's start */
    int has_first;
    double first_ms;         /* when its first token was drawn */
    int ended;               /* its done went out */
    fr_buf text;             /* the text the engine made final so far (requests with return_text) */
    size_t text_sent;        /* bytes of it streamed in deltas */
} sample_state;

/* An accepted generate. sid is the scheduler's id for it (the server's
 * own, increasing), so two clients' equal request ids never meet there. */
typedef struct {
    uint64_t sid;
    uint64_t request_id, group_id;
    int peer;
    int n, n_prompt, open;
    int first_sample;        /* the wire's sample of q->s[k] is first_sample + k, as the engine's */
    int start;               /* a continuation's continued tokens: its deltas count from there */
    int held;                /* received during a pause: not yet submitted */
    fr_request_spec spec;    /* held: prompt and stop ids owned here */
    double t0_ms;            /* when it was received */
    uint64_t seed;           /* its own, or the one the server drew for it; every done reports it */
    int engine;              /* several ranks: the engine serving it */
    int from_held;           /* submitted by a resume (a refusal then ends its samples) */
    sample_state *s;
    /* text (server_text.c) */
    int return_text;         /* deltas and dones carry text */
    char **stops;            /* the stop strings (owned); a done names the one that matched */
    int n_stops, include_stop, keep_special;
    int *prompt_ids;         /* the ids prompt_text became (owned), NULL when it came as ids */
} request;

/* Several ranks: what rank 0 sends every rank each turn (engine events; a
 * weight update's, over either transport, are EV_UPD_*)... */
enum { EV_SUBMIT = 1, EV_ABORT, EV_ABORT_ALL, EV_UPD_BEGIN, EV_UPD_BUCKET, EV_UPD_DROP, EV_UPD_COMMIT,
       EV_NCCL_INIT, EV_NCCL_END, EV_MODE, EV_RECOMPUTE };
/* ...and what each engine leader (OB_NCCL: any rank) sends rank 0 after its step. */
enum { OB_TOKEN = 1, OB_DONE, OB_REJECT, OB_STATS, OB_NCCL, OB_TEXT };

/* A reply encoded now and sent once this turn's results went out. */
typedef struct {
    int peer;
    char *data;
    size_t len;
} deferred_msg;

/* The ZAP handler (ZeroMQ's authentication protocol, RFC 27) of a CURVE
 * server: a thread answering inproc://zeromq.zap.01 that accepts a client
 * exactly when its public key is listed. */
typedef struct {
    void *sock;              /* REP, bound in the server's context */
    unsigned char (*keys)[32];
    int n_keys;
    int n_trainers;          /* keys[0, n_trainers) have the trainer role, the rest the rollout-client role */
    double last_refusal_ms;  /* refusals are logged once a second at most (a flood writes one line a second) */
    long long refusals_unlogged;
    FILE *log;
    pthread_t thread;
    int started;
} zap_handler;

struct fr_bridge_server {
    fr_session *sess;
    fr_scheduler *sch;
    fr_bridge_config cfg;
    void *zctx, *sock;
    void *monitor;           /* PAIR: the socket monitor's events (server_conn.c), NULL when none */
    int heartbeat_timeout_ms; /* 0: no heartbeats */
    uint64_t max_array;      /* the longest array a legal message holds (fr_msg_check_bounds) */
    uint64_t clients_departed; /* clients whose connection ended with something open or not */
    uint64_t held_aborted;   /* samples of held requests ended by abort (the scheduler never saw them) */
    int roles;               /* 1: CURVE with trainer keys: trainer-only messages need the trainer role */
    uint64_t forbidden;      /* messages refused for the sender's role */
    fr_peers *peers;
    zap_handler zap;
    FILE *log;
    char endpoint[256];
    request **reqs;          /* open requests, sorted by sid */
    int n_reqs, cap_reqs;
    uint64_t next_sid;
    /* Seeds of unseeded generates, drawn on rank 0 before routing so that
     * a request's seed does not depend on the engine that runs it. */
    fr_seed_stream seeds;
    int state;
    fr_pause_mode pause_mode; /* paused or pausing: the mode in force (server_pause.c) */
    int *waiters;            /* peers waiting for a pause (wait mode) to complete */
    int n_waiters, cap_waiters;
    int vocab, n_blocks, max_pos, max_seqs, chunk;
    int moe_layers;                   /* the model's MoE layers: 0 refuses return_routed_experts */
    int default_stop[FR_BRIDGE_MAX_STOP_IDS];
    int n_default_stop;
    uint64_t weight_version;
    /* the weight update in progress on this rank, over either transport
     * (NULL when none); rank 0 also knows its client and when its last
     * message arrived */
    fr_weight_update *upd;
    int upd_nccl;             /* its buckets come over the client's NCCL group (ng) */
    int upd_failed;           /* ranks other than 0: staging it failed here, so this rank votes no */
    /* the stages of the last updates that ended (committed or dropped),
     * reused by the next so they need no fresh pages (ng_spare: a
     * tensor-parallel rank's shard stage of weights over NCCL); NULL: none */
    fr_weight_update *spare, *ng_spare;
    int upd_peer;
    double upd_last_ms;
    uint64_t updates_committed, updates_failed;
    fr_hist update_seconds;  /* begin to commit of each committed update (metrics) */
    int stopping;            /* the loop has ended: /health answers 503 */
    /* protocol counters (stats) */
    uint64_t messages_in, messages_out, bad_messages, errors_sent;
    uint64_t requests_accepted, requests_rejected, samples_done, tokens_streamed;
    /* metrics endpoint (rollout/monitor/metrics_http.h), NULL when off */
    fr_metrics_http *metrics;
    /* the same snapshots on a ZeroMQ PUB socket (metrics_pub.h), NULL when off */
    fr_metrics_pub *pub;
    int pub_failed;   /* a send failed once: logged, not again */
    /* automatic recalibration (rollout/monitor/recalibrate.h), NULL when off */
    fr_recal *recal;
    double started_ms, upd_begin_ms, last_sync_s, last_pub_ms;
    long long last_pub_tokens;
    double last_stats_ms;          /* the last serving summary line (srv_log_stats) */
    long long last_stats_tokens;
    /* Several ranks (multi): this rank's place; rank 0 alone has the socket
     * and the request table. */
    const fr_mpi_world *world;
    int multi, rank, tp, n_engines, engine, leader;
    fr_rank_buf events;       /* rank 0: the engine events of this turn */
    fr_rank_buf outbox;       /* engine leaders: this turn's tokens, ends and stats */
    int *engine_open;         /* rank 0: open samples per engine (routing) */
    int next_engine;          /* rank 0: where the routing's tie-break starts */
    fr_scheduler_stats agg;   /* rank 0: the engines' stats summed, as of the last turn */
    int turn_barrier;         /* rank 0: stop reading messages this turn (a commit waits for the ranks) */
    deferred_msg *deferred;
    int n_deferred, cap_deferred;
    fr_status fatal;          /* a failure every rank saw alike: the loop ends */
    /* weights over NCCL (rollout/engine/weight_recv.h): a client's group, NULL when none */
    fr_weight_recv *ng;
    int *ng_acks;             /* rank 0 of several: buckets each rank has checked in the NCCL update */
    int ng_announced;         /* rank 0 of several: buckets of it passed to the ranks */
    int ng_replied;           /* rank 0 of several: buckets answered (every rank had checked them) */
    int ng_gen;               /* several ranks: groups joined so far (a report names its group) */
    int ng_peer;              /* the client whose group it is */
    int ng_commit;            /* 1: that client's commit waits for buckets in flight */
    uint64_t ng_commit_version;
    srv_local *local;         /* in-process clients (server_local.c), NULL when none */
    int released;             /* 1: the KV cache's memory given back, 2: the weights' too; generates refused */
};

/* server_stream.c: the request table, sending, streaming tokens and ends */
void srv_divergence_of(const fr_sample_result *r, fr_msg_divergence *div);
int srv_end_all(fr_bridge_server *srv, fr_wire_finish why);
request *srv_find_caller(const fr_bridge_server *srv, int peer, uint64_t request_id);
request *srv_find_sid(const fr_bridge_server *srv, uint64_t sid);
void srv_flush_all(fr_bridge_server *srv);
void srv_free_request(request *q);
void srv_on_done(void *user, const fr_sample_result *r);
void srv_on_token(void *user, uint64_t sid, int sample, int index, int token, float logprob);
void srv_remove_request(fr_bridge_server *srv, request *q);
void srv_send_deferred(fr_bridge_server *srv);
/* res (may be NULL): the engine's result, for its top and prompt log-probs. */
void srv_send_done(fr_bridge_server *srv, request *q, int k, fr_wire_finish why, int n_tokens, int preemptions,
                   const fr_msg_divergence *div, const fr_sample_result *res);
void srv_send_error(fr_bridge_server *srv, int peer, const char *code, int has_id, uint64_t id,
                    const char *fmt, ...) __attribute__((format(printf, 6, 7)));
void srv_send_later(fr_bridge_server *srv, int peer, const fr_msg *m);
void srv_send_msg(fr_bridge_server *srv, int peer, const fr_msg *m);
void srv_token_in(fr_bridge_server *srv, uint64_t sid, int sample, int index, int token, float logprob,
                  uint64_t version);
fr_wire_finish srv_wire_finish(fr_finish_reason r);

/* server_text.c: prompts as text, stop strings, text out */
fr_status srv_text_request(fr_bridge_server *srv, request *q, const fr_msg_generate *g);
void srv_text_spec(const request *q, fr_request_spec *spec);
void srv_text_free(request *q);
void srv_put_text_spec(fr_rank_buf *b, const fr_request_spec *r);
/* The text part of a submit record into spec; *owned the strings to free
 * (srv_free_strs, spec->stop_strings.n of them). -1 when out of memory; a
 * malformed record sets r->bad. */
int srv_get_text_spec(fr_rank_reader *r, fr_request_spec *spec, char ***owned);
void srv_free_strs(char **s, int n);
void srv_text_in(fr_bridge_server *srv, uint64_t sid, int sample, const char *text, size_t len);
void srv_on_text(void *user, uint64_t sid, int sample, int index, const char *text, size_t len);
void srv_take_text(fr_bridge_server *srv, fr_rank_reader *r);
/* A delta's text: what the engine made final since the last delta. */
void srv_text_delta(const request *q, sample_state *s, fr_msg_tokens *t);
/* A done's text, stop string and prompt ids (pointers into q, s or res). */
void srv_text_done(const request *q, const sample_state *s, const fr_sample_result *res, fr_msg_done *d);

/* server_requests.c: the engines and the requests that come in */
int srv_abort_held(fr_bridge_server *srv, request *q);
int srv_abort_sid(fr_bridge_server *srv, uint64_t sid);
fr_status srv_check_spec(const fr_bridge_server *srv, const fr_request_spec *r, uint64_t caller_id);
fr_status srv_eng_abort_all(fr_bridge_server *srv, int *n);
fr_status srv_eng_submit(fr_bridge_server *srv, request *q, const fr_request_spec *spec);
int srv_engine_samples(const fr_bridge_server *srv);
void srv_handle_abort(fr_bridge_server *srv, int peer, const fr_msg_abort *a);
void srv_handle_generate(fr_bridge_server *srv, int peer, const fr_msg_generate *g);
void srv_handle_hello(fr_bridge_server *srv, int peer);
void srv_handle_stats(fr_bridge_server *srv, int peer);
uint64_t *srv_sids_of(const fr_bridge_server *srv, int peer, int *n);

/* server_pause.c: pause modes, resume, the engines' modes on every rank */
/* Whether the engines have a step to take (rank 0: the poll's wait). */
int srv_engines_busy(const fr_bridge_server *srv);
void srv_fail_waiters(fr_bridge_server *srv, const char *code, const char *why);
void srv_handle_pause(fr_bridge_server *srv, int peer, const fr_msg_pause *p);
void srv_handle_resume(fr_bridge_server *srv, int peer, const fr_msg_resume *r);
/* A wait pause whose samples in flight have all ended is answered. */
void srv_pause_progress(fr_bridge_server *srv);
void srv_reply_waiters(fr_bridge_server *srv);

/* server_weights.c: weight updates, both transports, and the one commit */
void srv_apply_update(fr_bridge_server *srv, int ev, fr_rank_reader *r);
void srv_commit_update(fr_bridge_server *srv, uint64_t version);
void srv_drop_idle_update(fr_bridge_server *srv);
void srv_drop_update(fr_bridge_server *srv, const char *why);
void srv_end_update_here(fr_bridge_server *srv);
void srv_fail_update(fr_bridge_server *srv, int peer, const char *code);
void srv_handle_update_abort(fr_bridge_server *srv, int peer, uint64_t version);
void srv_handle_update_begin(fr_bridge_server *srv, int peer, const fr_msg_update_begin *b);
void srv_handle_update_bucket(fr_bridge_server *srv, int peer, const fr_msg_update_bucket *b,
                              const fr_wire_msg *w);
void srv_handle_update_commit(fr_bridge_server *srv, int peer, uint64_t version);
void srv_keep_spare(fr_bridge_server *srv, fr_weight_update *w);
void srv_request_commit(fr_bridge_server *srv, uint64_t version);
void srv_send_update_reply(fr_bridge_server *srv, int peer, uint64_t version, fr_update_stage stage, int bucket,
                           uint64_t bytes);
int srv_update_of(fr_bridge_server *srv, int peer, const char *what, uint64_t version);

/* server_nccl.c: a client's NCCL weight group and the buckets over it */
void srv_handle_nccl_bucket(fr_bridge_server *srv, int peer, const fr_msg_nccl_bucket *b);
void srv_handle_nccl_close(fr_bridge_server *srv, int peer);
void srv_handle_nccl_init(fr_bridge_server *srv, int peer, const fr_msg_nccl_init *n);
void srv_nccl_commit_when_received(fr_bridge_server *srv, uint64_t version);
void srv_nccl_end(fr_bridge_server *srv, const char *why, const char *code);
void srv_nccl_lost(fr_bridge_server *srv, const char *code);
int srv_nccl_pending(const fr_bridge_server *srv);
void srv_nccl_turn(fr_bridge_server *srv);

/* server_nccl_ranks.c: weights over NCCL into several ranks */
void srv_nccl_ack(fr_bridge_server *srv, int rank, int bucket);
int srv_nccl_all_acked(const fr_bridge_server *srv);
void srv_nccl_apply(fr_bridge_server *srv, int ev, fr_rank_reader *r);
void srv_nccl_fail_here(fr_bridge_server *srv, const char *code);
void srv_nccl_follower_turn(fr_bridge_server *srv);
fr_status srv_nccl_join(fr_bridge_server *srv, const unsigned char *id, int nranks, int timeout_ms);
void srv_nccl_reset_acks(fr_bridge_server *srv);
void srv_nccl_take_report(fr_bridge_server *srv, fr_rank_reader *r);

/* server.c: logging, dispatch and lifecycle */
void srv_log(fr_bridge_server *srv, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int srv_abort_everything(fr_bridge_server *srv);
void srv_drop_gone_peers(fr_bridge_server *srv);
void srv_handle_message(fr_bridge_server *srv, fr_wire_msg *w);
void srv_publish_metrics(fr_bridge_server *srv);
void srv_log_stats(fr_bridge_server *srv, int final);   /* the periodic summary line (final: the run's) */
int srv_publishes(const fr_bridge_server *srv);

/* server_conn.c: heartbeats, the size limit, departed clients */
void srv_conn_arrived(fr_bridge_server *srv, int peer, int fd);
void srv_conn_close(fr_bridge_server *srv);
void srv_conn_refused(size_t bytes);
fr_status srv_conn_setup(fr_bridge_server *srv, const fr_bridge_config *cfg);
void srv_conn_watch(fr_bridge_server *srv);
long long srv_max_message_bytes(const fr_bridge_config *cfg);

/* server_local.c: in-process clients (the HTTP API) */
int srv_local_client_of(const fr_bridge_server *srv, int peer);   /* -1: a ZeroMQ peer */
void srv_local_deliver(fr_bridge_server *srv, int client, const fr_msg *m);
void srv_local_drain(fr_bridge_server *srv, const volatile sig_atomic_t *stop, int at_barrier);
int srv_poll(fr_bridge_server *srv, long wait_ms);   /* the socket and the local queue; zmq_poll's result */
void srv_local_close(fr_bridge_server *srv);
void srv_local_destroy(fr_bridge_server *srv);

/* server_auth.c: CURVE authentication */
fr_status srv_setup_curve(fr_bridge_server *srv, const fr_bridge_config *cfg);

/* server_ranks.c: several ranks */
fr_status srv_apply_events(fr_bridge_server *srv);
void srv_comm_fatal(fr_bridge_server *srv, const char *what);
fr_status srv_handle_waiting(fr_bridge_server *srv, const volatile sig_atomic_t *stop, int at_barrier);
void srv_answer_waiting(fr_bridge_server *srv);
fr_status srv_run_ranks(fr_bridge_server *srv, const volatile sig_atomic_t *stop);

#endif
