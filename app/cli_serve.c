/* fp4rollout serve: the trainer-facing service (docs/protocol.md) on one
 * engine, or under mpirun on the world's engines of tp ranks each,
 * configured by a JSON file (configs/README.md). */
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "app/serve_config.h"
#include "app/serve_flags.h"
#include "base/log.h"
#include "rollout/engine/session.h"
#include "app/tp_launch.h"
#include "trainer_bridge/server/server.h"

static const char usage_text[] =
    "usage: fp4rollout serve [--config FILE] [--model M] [--kv T] [--port P] [flags]\n"
    "\n"
    "Serves rollouts to trainers over ZeroMQ (protocol version 1, docs/protocol.md):\n"
    "one ROUTER socket bound to tcp://BIND:PORT from the configuration's\n"
    "coordinator.bind and coordinator.port (default tcp://127.0.0.1:5555), one\n"
    "engine with the configuration's model, backend, KV cache, max_seqs, kv_blocks\n"
    "and chunk, and its sampling defaults for what a request leaves out.\n"
    "Weight updates arrive on the same socket (update_weights_*: bucketed, checksummed,\n"
    "committed between engine steps); kl_sample_rate picks the samples that run a\n"
    "BF16-KV shadow; a curve object turns on CURVE authentication; metrics_port\n"
    "and metrics_pub_port serve the metrics (HTTP, and a ZeroMQ PUB socket); a\n"
    "recalibration object recalibrates the key mean when a weight version's\n"
    "monitored KL passes a threshold (docs/metrics.md).\n"
    "SIGINT or SIGTERM shut it down: every open sample first gets its done\n"
    "message with reason abort. Logs go to stderr.\n"
    "\n"
    "  --config FILE          the serve configuration (JSON, every key optional;\n"
    "                         configs/README.md lists the keys). Optional: the\n"
    "                         flags below alone configure a server, and override\n"
    "                         the file's values when both are given\n"
    "  --model M              model (default: the bundled demo model)   [model]\n"
    "  --backend B            auto, cpu or cuda                         [backend]\n"
    "  --kv T, --kv-cache-dtype T  bf16, fp8, nvfp4, mxfp4 or f32      [kv_dtype]\n"
    "  --fp4-compute C        auto, exact or bf16                       [fp4_compute]\n"
    "  --recipe R             full or vanilla, with switches            [recipe]\n"
    "  --calib FILE           calibration file                          [calib]\n"
    "  --tp N, --tensor-parallel-size N  ranks per engine              [tp]\n"
    "  --max-seqs N, --max-num-seqs N    sequences run at once         [max_seqs]\n"
    "  --kv-blocks N          KV pages per engine                       [kv_blocks]\n"
    "  --chunk N              most tokens of one step                   [chunk]\n"
    "  --max-model-len N      cap on the context window                 [max_model_len]\n"
    "  --deterministic        batch-invariant numbers                   [deterministic]\n"
    "  --bind HOST            address to bind                           [coordinator.bind]\n"
    "  --port P               trainer-facing port                       [coordinator.port]\n"
    "  --metrics-port P       HTTP metrics and dashboard port (default 8000,\n"
    "                         or a free one when taken; 0: off)         [metrics_port]\n"
    "  --metrics-pub-port P   ZeroMQ PUB metrics port                   [metrics_pub_port]\n"
    "  --kl-sample-rate R     share of samples with a BF16-KV shadow    [kl_sample_rate]\n"
    "  --temperature T, --top-p P, --top-k K, --max-tokens N\n"
    "                         defaults of requests that leave them out  [sampling.*]\n"
    "  --log-stats-interval S the serving summary every S seconds (default 10,\n"
    "                         0: never): tokens/s, running and waiting samples, KV\n"
    "                         use, weight version                [log_stats_interval_s]\n"
    "  --log-level L          debug, info (default), warn, error or off\n"
    "\n"
    "Under mpirun -np W with the configuration's tp T, the W ranks form W / T\n"
    "engines of T tensor-parallel ranks; world rank 0 owns the socket, routes each\n"
    "request to the engine with the fewest open samples and streams every engine's\n"
    "results; a weight update is committed on every rank or on none. A signal to\n"
    "any rank shuts every rank down; a rank that fails makes every rank exit\n"
    "non-zero.\n";

static volatile sig_atomic_t stop_flag = 0;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

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

int fr_cli_serve(int argc, char **argv)
{
    const char *cmd = "serve", *path = NULL;
    if (fr_cli_wants_help(argc, argv)) {
        printf("%s", usage_text);
        return 0;
    }
    if (fr_cli_args(cmd, &argc, &argv, (const struct option *const[]){fr_serve_longopts, NULL})) return 2;
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--config") == 0) path = argv[++i];
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
    fr_serve_config c;
    fr_serve_config_default(&c);
    snprintf(c.model, sizeof c.model, "%s", fr_cli_demo_model());
    if ((path && fr_serve_config_load(path, &c)) || fr_serve_flags_apply(argc, argv, &c)) {
        fprintf(stderr, "fp4rollout serve: %s\n", fr_last_error());
        return 2;
    }
    if (!path) path = "command line";
    fr_engine_opts eo;
    fr_serve_config_engine_opts(&c, &eo);
    fr_backend backend;
    if (fr_backend_pick(eo.backend, &backend)) {
        fprintf(stderr, "fp4rollout serve: %s\n", fr_last_error());
        return 1;
    }
    int kv_blocks = c.kv_blocks;
    if (kv_blocks == 0) {
        if (backend == FR_BACKEND_CUDA) {
            fprintf(stderr,
                    "fp4rollout serve: %s: kv_blocks 0 (KV pages sized by kv_memory_fraction) is not built yet "
                    "for the cuda backend; give kv_blocks\n",
                    path);
            return 2;
        }
        kv_blocks = c.max_seqs * FR_SERVE_CPU_PAGES_PER_SEQ;
    }
    eo.backend = backend;
    /* Every rank reads the same configuration, so the checks above fail on
     * every rank alike; from here on, failures are agreed on. */
    if (c.tp > 1 && !fr_tp_under_mpirun()) {
        fprintf(stderr,
                "fp4rollout serve: %s: tp %d needs several ranks per engine: start it with mpirun -np N, N a "
                "multiple of %d\n",
                path, c.tp, c.tp);
        return 2;
    }
    fr_tp_launch tl;
    if (fr_tp_launch_open(c.tp, &tl)) {
        fprintf(stderr, "fp4rollout serve: %s: %s\n", path, fr_last_error());
        return 2;
    }
    eo.group = tl.group;
    fr_session s;
    int opened = fr_session_open(&eo, kv_blocks, c.max_seqs, &s) == FR_OK;
    if (!opened) fprintf(stderr, "fp4rollout serve: %s\n", fr_last_error());
    if (!all_ranks_ok(&tl, opened)) {
        if (opened) fr_session_close(&s);
        fr_tp_launch_close(&tl);
        return 1;
    }
    const fr_model_config *mc = &s.model->cfg;
    for (int i = 0; i < c.sampling.n_stop; i++)
        if (c.sampling.stop_token_ids[i] >= mc->vocab_size) {
            fprintf(stderr, "fp4rollout serve: %s: sampling.stop_token_ids[%d] = %d is outside the vocabulary (%d)\n",
                    path, i, c.sampling.stop_token_ids[i], mc->vocab_size);
            fr_session_close(&s);
            fr_tp_launch_close(&tl);
            return 2;
        }
    char endpoint[FR_SERVE_HOST_MAX + 32];
    snprintf(endpoint, sizeof endpoint, "tcp://%s:%d", c.coordinator.bind, c.coordinator.port);
    char pub_endpoint[FR_SERVE_HOST_MAX + 32] = "";
    if (c.metrics_pub_port)
        snprintf(pub_endpoint, sizeof pub_endpoint, "tcp://%s:%d", c.coordinator.bind, c.metrics_pub_port);
    const char *client_keys[FR_SERVE_MAX_CURVE_CLIENTS];
    for (int i = 0; i < c.curve.n_clients; i++) client_keys[i] = c.curve.client_public_keys[i];
    const char *trainer_keys[FR_SERVE_MAX_CURVE_CLIENTS];
    for (int i = 0; i < c.curve.n_trainers; i++) trainer_keys[i] = c.curve.trainer_public_keys[i];
    fr_bridge_config bc = {.endpoint = endpoint, .model_name = c.model, .max_seqs = c.max_seqs, .chunk = c.chunk,
                           .sampling = c.sampling, .shutdown_linger_ms = 2000, .log = stderr,
                           .kl_sample_rate = c.kl_sample_rate,
                           .update_idle_ms = (int)(c.weight_update_idle_s * 1000.0 + 0.5),
                           .stats_log_ms = c.log_stats_interval_s > 0 ? (int)(c.log_stats_interval_s * 1000.0 + 0.5) : -1,
                           .nccl_timeout_ms = (int)(c.nccl_timeout_s * 1000.0 + 0.5),
                           .curve_secret_key = c.curve.server_secret_key, .curve_client_keys = client_keys,
                           .n_curve_client_keys = c.curve.n_clients, .metrics_port = c.metrics_port,
                           .metrics_port_fallback = c.metrics_port_default,
                           .metrics_bind = c.coordinator.bind, .metrics_pub_endpoint = pub_endpoint,
                           .metrics_log = c.metrics_log,
                           .world = tl.world, .tp = c.tp,
                           .heartbeat_ms = c.coordinator.heartbeat_ms > 0 ? c.coordinator.heartbeat_ms : -1,
                           .heartbeat_timeout_ms = c.coordinator.heartbeat_timeout_ms,
                           .max_message_bytes = c.coordinator.max_message_bytes,
                           .curve_trainer_keys = trainer_keys, .n_curve_trainer_keys = c.curve.n_trainers,
                           .metrics_max_connections = c.metrics_http.max_connections,
                           .metrics_idle_timeout_s = c.metrics_http.idle_timeout_s,
                           .metrics_token = c.metrics_http.token};
    /* automatic recalibration: the config's texts and folder, by pointer */
    const char *recal_texts[FR_SERVE_MAX_RECAL_TEXTS];
    for (int i = 0; i < c.recalibration.n_texts; i++) recal_texts[i] = c.recalibration.texts[i];
    const fr_recal_config rc = {.kl_threshold = c.recalibration.kl_threshold,
                                .after_commit = c.recalibration.after_commit,
                                .min_positions = c.recalibration.min_positions,
                                .n_texts = c.recalibration.n_texts, .texts = recal_texts,
                                .context = c.recalibration.context, .seed_tokens = c.recalibration.seed_tokens,
                                .continue_tokens = c.recalibration.continue_tokens,
                                .out_dir = c.recalibration.out_dir};
    if (c.recalibration.kl_threshold > 0 || c.recalibration.after_commit) bc.recal = &rc;
    fr_bridge_server *srv = NULL;
    int made = fr_bridge_server_new(&s, &bc, &srv) == FR_OK;
    if (!made) fprintf(stderr, "fp4rollout serve: %s\n", fr_last_error());
    if (!all_ranks_ok(&tl, made)) {
        fr_bridge_server_destroy(&srv);
        fr_session_close(&s);
        fr_tp_launch_close(&tl);
        return 1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (tl.output_rank)
        fr_info("serve: model %s backend %s kv %s max_seqs %d kv_blocks %d chunk %d kl_sample_rate %g "
                "engines %d tp %d ranks %d",
                c.model, fr_backend_name(s.backend), fr_kv_dtype_name(c.kv_dtype), c.max_seqs, kv_blocks, c.chunk,
                c.kl_sample_rate, tl.n_engines, c.tp, tl.world_size);
    /* from here on a lost rank ends the job after rank_timeout_s instead of
     * freezing it (docs/failures.md); loading may take longer, so not before */
    if (tl.world) fr_mpi_world_set_timeout(tl.world, c.coordinator.rank_timeout_s * 1000);
    fr_status st = fr_bridge_server_run(srv, &stop_flag);
    if (st) fprintf(stderr, "fp4rollout serve: %s\n", fr_last_error());
    fr_bridge_server_destroy(&srv);
    fr_session_close(&s);
    fr_tp_launch_close(&tl);
    if (tl.output_rank) fr_info("serve: stopped");
    return st ? 1 : 0;
}
