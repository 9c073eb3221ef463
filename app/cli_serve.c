/* fp4rollout serve: the trainer-facing service (docs/protocol.md) on one
 * engine, or under mpirun on the world's engines of tp ranks each,
 * configured by a JSON file (configs/README.md). */
#include <malloc.h>
#include <stdio.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "app/serve_config.h"
#include "app/serve_curve.h"
#include "app/serve_flags.h"
#include "base/log.h"
#include "rollout/engine/session.h"
#include "app/tp_launch.h"
#include "trainer_bridge/http/http.h"
#include "trainer_bridge/server/server.h"

const char fr_serve_usage[] =
    "usage: fp4rollout serve [--config FILE] [--model M] [--kv T] [--port P] [flags]\n"
    "\n"
    "Serves rollouts to trainers over ZeroMQ (protocol version 1, docs/protocol.md):\n"
    "one ROUTER socket bound to tcp://BIND:PORT from the configuration's\n"
    "coordinator.bind and coordinator.port (default tcp://127.0.0.1:5555), one\n"
    "engine with the configuration's model, backend, KV cache, max_seqs, kv_blocks\n"
    "and chunk, and its sampling defaults for what a request leaves out.\n"
    "Weight updates arrive on the same socket (update_weights_*: bucketed, checksummed,\n"
    "committed between engine steps); kl_sample_rate picks the samples that run a\n"
    "BF16-KV shadow; a curve object (or --curve-secret-key-file with --trainer-keys\n"
    "and --client-keys, or the FP4ROLLOUT_CURVE_* variables of the environment)\n"
    "turns on CURVE authentication, which a --bind beyond this host needs; metrics_port\n"
    "and metrics_pub_port serve the metrics (HTTP, and a ZeroMQ PUB socket); a\n"
    "recalibration object recalibrates the key mean when a weight version's\n"
    "monitored KL passes a threshold (docs/metrics.md).\n"
    "SIGINT or SIGTERM shut it down: every open sample first gets its done\n"
    "message with reason abort. Logs go to stderr.\n"
    "\n"
    "Every flag but --config sets the configuration key in brackets, over the\n"
    "file's value; the flags alone configure a server. Under mpirun -np W with the\n"
    "configuration's tp T, the W ranks form W / T engines of T tensor-parallel\n"
    "ranks; world rank 0 owns the socket, routes each request to the engine with\n"
    "the fewest open samples and streams every engine's results; a weight update\n"
    "is committed on every rank or on none. A signal to any rank shuts every rank\n"
    "down; a rank that fails makes every rank exit non-zero.\n";

/* With several ranks: whether every rank got this far (ok on this one). A
 * rank that failed has printed why; the others say that one did. */
static int all_ranks_ok(const fr_tp_launch *tl, int ok)
{
    if (!tl->world || tl->world_size < 2) return ok;
    int all = 0;
    if (fr_mpi_world_all_ok(tl->world, ok, &all)) {
        fprintf(stderr, "fp4rollout serve: rank %d: %s\n", tl->world_rank, fr_last_error());
        fr_mpi_world_abort(tl->world, 1);
        return 0;
    }
    if (ok && !all) fprintf(stderr, "fp4rollout serve: rank %d stops: another rank failed to start\n", tl->world_rank);
    return all;
}

/* The configuration: the defaults with the bundled demo model, then the
 * CURVE variables of the environment, the file, the flags; then the
 * server's secret key from its file, and where it may bind. 0, or the
 * exit status after printing why: 1 for a file that cannot be read, 2 for
 * a bad key or value. */
static int read_config(fr_cmd cmd, const fr_cli_values *v, fr_serve_config *c)
{
    fr_serve_config_default(c);
    snprintf(c->model, sizeof c->model, "%s", fr_cli_demo_model());
    const char *path = fr_opt_str(v, FR_O_CONFIG);
    fr_status st = fr_serve_curve_env(c);
    if (!st && path) st = fr_serve_config_load(path, c);
    if (!st) st = fr_serve_flags_apply(v, c);
    if (!st) st = fr_serve_curve_key_file(c);
    if (st) return fr_cli_fail(cmd, st == FR_EIO ? 1 : 2);
    return fr_serve_curve_check_bind(cmd, c);
}

/* What the server is told, and the arrays and strings it points into. */
typedef struct {
    char endpoint[FR_SERVE_HOST_MAX + 32], pub_endpoint[FR_SERVE_HOST_MAX + 32];
    const char *client_keys[FR_SERVE_MAX_CURVE_CLIENTS], *trainer_keys[FR_SERVE_MAX_CURVE_CLIENTS];
    const char *recal_texts[FR_SERVE_MAX_RECAL_TEXTS];
    fr_recal_config recal;
    fr_bridge_config bc;
} bridge_setup;

static int ms(double seconds)
{
    return (int)(seconds * 1000.0 + 0.5);
}

static void bridge_setup_fill(bridge_setup *b, const fr_serve_config *c, const fr_tp_launch *tl, const fr_cli_text *tx)
{
    snprintf(b->endpoint, sizeof b->endpoint, "tcp://%s:%d", c->coordinator.bind, c->coordinator.port);
    b->pub_endpoint[0] = '\0';
    if (c->metrics_pub_port)
        snprintf(b->pub_endpoint, sizeof b->pub_endpoint, "tcp://%s:%d", c->coordinator.bind, c->metrics_pub_port);
    for (int i = 0; i < c->curve.n_clients; i++) b->client_keys[i] = c->curve.client_public_keys[i];
    for (int i = 0; i < c->curve.n_trainers; i++) b->trainer_keys[i] = c->curve.trainer_public_keys[i];
    b->bc = (fr_bridge_config){
        .endpoint = b->endpoint, .model_name = c->model, .max_seqs = c->max_seqs, .chunk = c->chunk,
        .sampling = c->sampling, .shutdown_linger_ms = 2000, .log = stderr, .kl_sample_rate = c->kl_sample_rate,
        .update_idle_ms = ms(c->weight_update_idle_s),
        .stats_log_ms = c->log_stats_interval_s > 0 ? ms(c->log_stats_interval_s) : -1,
        .nccl_timeout_ms = ms(c->nccl_timeout_s), .curve_secret_key = c->curve.server_secret_key,
        .curve_client_keys = b->client_keys, .n_curve_client_keys = c->curve.n_clients,
        .metrics_port = c->metrics_port, .metrics_port_fallback = c->metrics_port_default,
        .metrics_bind = c->coordinator.bind, .metrics_pub_endpoint = b->pub_endpoint, .metrics_log = c->metrics_log,
        .world = tl->world, .tp = c->tp,
        .heartbeat_ms = c->coordinator.heartbeat_ms > 0 ? c->coordinator.heartbeat_ms : -1,
        .heartbeat_timeout_ms = c->coordinator.heartbeat_timeout_ms,
        .max_message_bytes = c->coordinator.max_message_bytes, .curve_trainer_keys = b->trainer_keys,
        .n_curve_trainer_keys = c->curve.n_trainers, .metrics_max_connections = c->metrics_http.max_connections,
        .metrics_idle_timeout_s = c->metrics_http.idle_timeout_s, .metrics_token = c->metrics_http.token,
        .metrics_external = 1, .tokenizer = tx->tok, .tokenizer_name = tx->name};
    /* automatic recalibration: the config's texts and folder, by pointer */
    const fr_serve_recal *r = &c->recalibration;
    for (int i = 0; i < r->n_texts; i++) b->recal_texts[i] = r->texts[i];
    b->recal = (fr_recal_config){.kl_threshold = r->kl_threshold, .after_commit = r->after_commit,
                                 .min_positions = r->min_positions, .n_texts = r->n_texts, .texts = b->recal_texts,
                                 .context = r->context, .seed_tokens = r->seed_tokens,
                                 .continue_tokens = r->continue_tokens, .out_dir = r->out_dir,
                                 .tokenizer = fr_cli_text_for_files(tx)};
    if (r->kl_threshold > 0 || r->after_commit) b->bc.recal = &b->recal;
}

/* The engine's KV pages and the ranks, as far as they can be checked
 * before any rank starts: 0, or the exit status after printing why. */
static int plan(fr_cmd cmd, const char *label, const fr_serve_config *c, fr_engine_opts *eo, int *kv_blocks)
{
    fr_backend backend;
    if (fr_backend_pick(eo->backend, &backend)) return fr_cli_fail(cmd, 1);
    eo->backend = backend;
    *kv_blocks = c->kv_blocks;
    /* kv_blocks 0: on one GPU, kv_memory_fraction of its memory, less the
     * weights, once they are loaded (fr_session_open, kv_blocks stays 0 until
     * then); on the CPU, and for an engine of several ranks (which must agree
     * on the size), a fixed share per sequence slot. */
    if (*kv_blocks == 0 && backend == FR_BACKEND_CUDA && c->tp == 1) {
        eo->kv_memory_fraction = c->kv_memory_fraction;
        eo->kv_shadow_share = c->kl_sample_rate;
    } else if (*kv_blocks == 0) {
        *kv_blocks = c->max_seqs * FR_SERVE_PAGES_PER_SEQ;
        if (backend == FR_BACKEND_CUDA)
            fr_info("serve: kv_blocks 0 with tp %d: %d pages (%d per sequence slot, %d tokens each); long samples "
                    "will be preempted and recomputed: give kv_blocks to size the cache to the GPUs", c->tp,
                    *kv_blocks, FR_SERVE_PAGES_PER_SEQ, FR_SERVE_PAGES_PER_SEQ * 128);
    }
    /* Every rank reads the same configuration, so the checks above fail on
     * every rank alike; from here on, failures are agreed on. */
    if (c->tp > 1 && !fr_tp_under_mpirun())
        return fr_cli_usage_error(cmd, "%s: tp %d needs several ranks per engine: start it with mpirun -np N, N a "
                                       "multiple of %d", label, c->tp, c->tp);
    return 0;
}

/* Stop ids the model's vocabulary does not have. */
static int check_stops(fr_cmd cmd, const char *label, const fr_serve_config *c, const fr_model_config *mc)
{
    for (int i = 0; i < c->sampling.n_stop; i++)
        if (c->sampling.stop_token_ids[i] >= mc->vocab_size)
            return fr_cli_usage_error(cmd, "%s: sampling.stop_token_ids[%d] = %d is outside the vocabulary (%d)",
                                      label, i, c->sampling.stop_token_ids[i], mc->vocab_size);
    return 0;
}

/* The HTTP API on world rank 0 (docs/http.md), on the metrics port, which
 * it serves too: its bind, limits and tokens from the configuration. */
static fr_status start_http(const fr_serve_config *c, fr_bridge_server *srv, fr_http **out)
{
    *out = NULL;
    if (c->metrics_port == 0) return FR_OK;
    const int curve = c->curve.server_secret_key[0] != 0, token = c->metrics_http.token[0] != 0;
    /* with CURVE on and no read token the figures are for this host only (docs/metrics.md) */
    const char *bind = curve && !token ? "127.0.0.1" : c->coordinator.bind;
    const fr_http_config hc = {.bind = bind, .port = c->metrics_port, .port_fallback = c->metrics_port_default,
                               .max_connections = c->metrics_http.max_connections,
                               .idle_timeout_s = c->metrics_http.idle_timeout_s,
                               .max_body_bytes = c->http.max_body_bytes, .read_token = c->metrics_http.token,
                               .client_token = c->http.client_token, .trainer_token = c->http.trainer_token,
                               .model_name = c->model};
    return fr_http_start(&hc, srv, out);
}

/* Thousands of HTTP connections at once need as many descriptors: the soft
 * limit goes up to the hard one. */
static void raise_fd_limit(void)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
        r.rlim_cur = r.rlim_max;
        setrlimit(RLIMIT_NOFILE, &r);
    }
}

/* The session and the server on it, run until a signal; on every rank. */
static int serve(fr_cmd cmd, const char *label, const fr_serve_config *c, fr_engine_opts *eo, int kv_blocks,
                 const fr_tp_launch *tl, const fr_cli_text *tx)
{
    fr_session s;
    int opened = fr_session_open(eo, kv_blocks, c->max_seqs, &s) == FR_OK;
    if (!opened) fr_cli_fail(cmd, 1);
    if (!all_ranks_ok(tl, opened)) {
        if (opened) fr_session_close(&s);
        return 1;
    }
    int rc = check_stops(cmd, label, c, &s.model->cfg), ran = 0;
    bridge_setup b;
    bridge_setup_fill(&b, c, tl, tx);
    fr_bridge_server *srv = NULL;
    fr_http *http = NULL;
    int made = !rc && fr_bridge_server_new(&s, &b.bc, &srv) == FR_OK;
    if (made && (!tl->world || tl->world_rank == 0) && start_http(c, srv, &http)) made = 0;
    if (!rc && !made) fr_cli_fail(cmd, 1);
    if (!rc && !all_ranks_ok(tl, made)) rc = 1;
    if (!rc) {
        volatile sig_atomic_t *stop = fr_cli_catch_stop();
        if (tl->output_rank)
            fr_info("serve: model %s backend %s kv %s max_seqs %d kv_blocks %d chunk %d kl_sample_rate %g "
                    "engines %d tp %d ranks %d tokenizer %s",
                    c->model, fr_backend_name(s.backend), fr_kv_dtype_name(c->kv_dtype), c->max_seqs,
                    fr_kv_cache_config_of(s.kv)->n_blocks,
                    c->chunk, c->kl_sample_rate, tl->n_engines, c->tp, tl->world_size,
                    tx->tok ? tx->name : "none (token ids only)");
        /* from here on a lost rank ends the job after rank_timeout_s instead of
         * freezing it (docs/failures.md); loading may take longer, so not before */
        if (tl->world) fr_mpi_world_set_timeout(tl->world, c->coordinator.rank_timeout_s * 1000);
        if (fr_bridge_server_run(srv, stop)) rc = fr_cli_fail(cmd, 1);
        ran = 1;
    }
    fr_http_stop(&http);   /* every call answered before the server goes */
    fr_bridge_server_destroy(&srv);
    fr_session_close(&s);
    if (ran && tl->output_rank) fr_info("serve: stopped");
    return rc;
}

int fr_cli_serve(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_SERVE;
    fr_serve_config c;
    fr_engine_opts eo;
    int rc, kv_blocks = 0;
    if ((rc = read_config(cmd, v, &c))) return rc;
    /* Weight updates allocate and free buffers of hundreds of MiB (ZeroMQ's
     * message per bucket on its I/O thread, the staging copy). glibc maps
     * each such block afresh and the kernel zeroes every page again on
     * first touch: that was about half the server's time of an update. A
     * serving process keeps its memory instead, so the next update reuses
     * warm pages (bench/RESULTS.md, weight sync): no mmap for large blocks,
     * no trimming, and one arena, because a thread's own arena maps a large
     * block whatever M_MMAP_MAX says. Its few threads rarely allocate. */
    mallopt(M_ARENA_MAX, 1);
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, -1);   /* never give the heap back */
    raise_fd_limit();
    const char *label = fr_opt_given(v, FR_O_CONFIG) ? fr_opt_str(v, FR_O_CONFIG) : "command line";
    fr_serve_config_engine_opts(&c, &eo);
    if ((rc = plan(cmd, label, &c, &eo, &kv_blocks))) return rc;
    /* Every rank's scheduler decodes for stop strings: every rank loads it. */
    fr_cli_text tx;
    if ((rc = fr_cli_text_open(cmd, c.model, c.tokenizer[0] ? c.tokenizer : NULL, &tx))) return rc;
    fr_tp_launch tl;
    fr_status st = fr_tp_launch_open(c.tp, &tl);
    if (st) {
        fprintf(stderr, "fp4rollout serve: %s: %s\n", label, fr_last_error());
        fr_cli_text_close(&tx);
        return st == FR_EINVAL ? 2 : 1;
    }
    eo.group = tl.group;
    rc = serve(cmd, label, &c, &eo, kv_blocks, &tl, &tx);
    fr_tp_launch_close(&tl);
    fr_cli_text_close(&tx);
    return rc;
}
