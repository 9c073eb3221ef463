/* The configuration of `fp4rollout serve`: one JSON object, every key
 * optional with a default, documented key by key in configs/README.md.
 *
 * Parsing is strict so that a typo cannot pass silently: an unknown key is an
 * error naming the key, the file and the nearest known key; a value of the
 * wrong type or out of range is an error naming its JSON path
 * ("coordinator.port", "sampling.stop_token_ids[2]"); so is a key given
 * twice, and so are settings that contradict each other. Checks that need
 * the model (tp against the head counts, stop ids against the vocabulary)
 * and the world (tp against mpirun -np) come later, when those are known.
 *
 * The struct holds no pointers and owns no memory: copy it freely; nothing
 * needs freeing. */
#ifndef FR_SERVE_CONFIG_H
#define FR_SERVE_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "base/fr_status.h"
#include "rollout/engine/session.h"
#include "trainer_bridge/server/server.h"

/* The metrics endpoint's port when the configuration names none (the port
 * vLLM users know for HTTP); a server whose default port is taken takes any
 * free one and logs it. */
#define FR_METRICS_PORT_DEFAULT 8000

#ifdef __cplusplus
extern "C" {
#endif

#define FR_SERVE_PATH_MAX 4096     /* model and calib paths, bytes with the NUL */
#define FR_SERVE_HOST_MAX 256      /* coordinator.bind */
#define FR_SERVE_MAX_STOP_IDS FR_BRIDGE_MAX_STOP_IDS   /* sampling.stop_token_ids */
/* kv_blocks 0 without sizing by GPU memory: this many KV pages per sequence
 * slot (max_seqs of them), i.e. 16 x 128 = 2048 tokens each. */
#define FR_SERVE_PAGES_PER_SEQ FR_SESSION_PAGES_PER_SEQ
#define FR_SERVE_MAX_CURVE_CLIENTS 64   /* curve.client_public_keys */
#define FR_SERVE_CURVE_KEY 41           /* a Z85 CURVE key: 40 characters and the NUL */
#define FR_SERVE_MAX_RECAL_TEXTS 8      /* recalibration.texts */

/* Default sampling parameters of requests that leave them out: the
 * server's own type, which cli_serve.c hands it as they are. */
typedef fr_bridge_sampling fr_serve_sampling;

/* Automatic recalibration of the key mean (docs/metrics.md). */
typedef struct {
    double kl_threshold;                   /* nats; 0: not by KL */
    int after_commit;                      /* 1: after every committed update too */
    int min_positions;                     /* monitored positions of a version before it is judged */
    int n_texts;
    char texts[FR_SERVE_MAX_RECAL_TEXTS][FR_SERVE_PATH_MAX];   /* seed texts (calibrate --texts) */
    int context, seed_tokens, continue_tokens;   /* as calibrate's --context, --seed-tokens, --continue */
    char out_dir[FR_SERVE_PATH_MAX];       /* each new calibration file goes here; "" none */
} fr_serve_recal;

typedef struct {
    char model[FR_SERVE_PATH_MAX];         /* checkpoint folder or synthetic:NAME[:SEED] */
    fr_backend backend;
    int tp;                                /* ranks per engine (tensor parallelism) */
    fr_kv_dtype kv_dtype;
    fr_fp4_compute fp4_compute;
    fr_recipe recipe;
    char calib[FR_SERVE_PATH_MAX];         /* calibration file; "" when none */
    char tokenizer[FR_SERVE_PATH_MAX];     /* tokenizer.json or its folder; "" the model's (app/cli_text.c) */
    int max_seqs;                          /* sequences decoded together by one engine */
    int kv_blocks;                         /* KV pages per engine; 0: automatic */
    double kv_memory_fraction;             /* kv_blocks 0 on one GPU: weights + KV cache share of its memory */
    int chunk;                             /* the most tokens of one forward step */
    int max_model_len;                     /* > 0: the context window capped at this */
    int deterministic;                     /* batch-invariant numbers (docs/determinism.md) */
    struct {
        char bind[FR_SERVE_HOST_MAX];      /* host or interface the coordinator binds */
        int port;                          /* trainer-facing: requests and results */
        int weight_port;                   /* trainer-facing: weight-update buckets */
        int engine_port;                   /* engine leaders to the coordinator */
        int heartbeat_ms;                  /* ZMTP heartbeat interval; 0: none */
        int heartbeat_timeout_ms;          /* a connection silent this long is closed, its requests aborted */
        int max_message_bytes;             /* the largest frame a client may send */
        int rank_timeout_s;                /* several ranks: a rank silent this long ends the job; 0: never */
    } coordinator;
    int metrics_port;                      /* 0: no metrics endpoint; default FR_METRICS_PORT_DEFAULT */
    int metrics_port_default;              /* metrics_port not given: another free port when it is taken */
    int metrics_pub_port;                  /* 0: no metrics PUB socket */
    char metrics_log[FR_SERVE_PATH_MAX];   /* history records appended here (JSON lines); "" none */
    struct {                               /* the metrics endpoint's limits (docs/metrics.md, "Limits") */
        int max_connections;
        int idle_timeout_s;
        char token[128];                   /* "": none required */
    } metrics_http;
    struct {                               /* the HTTP API's tokens and body limit (docs/http.md) */
        char client_token[128];            /* "": generation open to loopback peers only */
        char trainer_token[128];           /* "": control open to loopback peers only */
        int max_body_bytes;
    } http;
    double kl_sample_rate;                 /* share of samples with a BF16-KV shadow */
    double log_stats_interval_s;           /* the serving summary line every this many seconds; 0: never */
    double weight_update_idle_s;           /* a staged weight update idle this long is dropped; 0: never */
    double nccl_timeout_s;                 /* an NCCL weight group without progress this long is aborted */
    struct {                               /* CURVE authentication of the trainer-facing socket */
        char server_secret_key[FR_SERVE_CURVE_KEY];   /* "" when off (or given by the file below) */
        char server_secret_key_file[FR_SERVE_PATH_MAX];   /* a file holding it; "" none (app/serve_curve.h) */
        int n_clients;
        char client_public_keys[FR_SERVE_MAX_CURVE_CLIENTS][FR_SERVE_CURVE_KEY];
        int n_trainers;                    /* keys with the trainer role (docs/protocol.md, "Roles") */
        char trainer_public_keys[FR_SERVE_MAX_CURVE_CLIENTS][FR_SERVE_CURVE_KEY];
    } curve;
    fr_serve_sampling sampling;
    fr_serve_recal recalibration;
} fr_serve_config;

/* Every key at its default (configs/README.md). */
void fr_serve_config_default(fr_serve_config *c);

/* Parses the JSON text (len bytes, need not end in NUL) over the defaults.
 * label names the text in messages (usually the file name). Relative paths
 * are kept as written. On failure *c is left unchanged. */
fr_status fr_serve_config_parse(const char *text, size_t len, const char *label, fr_serve_config *c);

/* Reads and parses a file; relative model and calib paths are taken
 * relative to the file's folder, so a configuration works from any working
 * directory. On failure *c is left unchanged. */
fr_status fr_serve_config_load(const char *path, fr_serve_config *c);

/* The engine options of the configuration, pointing into c (valid while c
 * lives and is unchanged). */
void fr_serve_config_engine_opts(const fr_serve_config *c, fr_engine_opts *o);

/* The whole configuration as JSON (every key, pretty-printed), which parses
 * back to the same configuration; *json is malloc'ed, the caller frees it. */
fr_status fr_serve_config_to_json(const fr_serve_config *c, char **json);

#ifdef __cplusplus
}
#endif

#endif
