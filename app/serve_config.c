#include "app/serve_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/model.h"

/* The keys, by object. Every one is documented in configs/README.md. */
static const char *const top_keys[] = {
    "model",     "backend",            "tp",    "kv_dtype",    "fp4_compute",  "recipe",         "calib",   "max_seqs",
    "kv_blocks", "kv_memory_fraction", "chunk", "coordinator", "metrics_port", "metrics_pub_port", "kl_sample_rate", "sampling",
    "weight_update_idle_s", "nccl_timeout_s", "curve", "recalibration", "deterministic", "metrics_log", "metrics_http",
    "max_model_len", "log_stats_interval_s"};
static const char *const metrics_http_keys[] = {"max_connections", "idle_timeout_s", "token"};
static const char *const recal_keys[] = {"kl_threshold", "after_commit", "min_positions", "texts", "context",
                                         "seed_tokens", "continue", "out_dir"};
static const char *const curve_keys[] = {"server_secret_key", "client_public_keys", "trainer_public_keys"};
static const char *const coordinator_keys[] = {"bind", "port", "weight_port", "engine_port", "heartbeat_ms",
                                               "heartbeat_timeout_ms", "max_message_bytes", "rank_timeout_s"};
static const char *const sampling_keys[] = {"temperature", "top_k", "top_p", "max_tokens", "stop_token_ids", "seed"};
#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

void fr_serve_config_default(fr_serve_config *c)
{
    memset(c, 0, sizeof *c);
    snprintf(c->model, sizeof c->model, "synthetic:tiny");
    c->backend = FR_BACKEND_AUTO;
    c->tp = 1;
    c->kv_dtype = FR_KV_BF16;
    c->fp4_compute = FR_COMPUTE_AUTO;
    c->recipe = fr_recipe_full();
    c->max_seqs = 64;
    c->kv_blocks = 0;
    c->kv_memory_fraction = 0.9;
    c->chunk = 512;
    snprintf(c->coordinator.bind, sizeof c->coordinator.bind, "127.0.0.1");
    c->coordinator.port = 5555;
    c->coordinator.weight_port = 5556;
    c->coordinator.engine_port = 5557;
    c->coordinator.heartbeat_ms = 1000;
    c->coordinator.heartbeat_timeout_ms = 10000;
    c->coordinator.max_message_bytes = 1 << 30;
    c->coordinator.rank_timeout_s = 60;
    c->metrics_port = FR_METRICS_PORT_DEFAULT;
    c->metrics_port_default = 1;
    c->metrics_pub_port = 0;
    c->metrics_http.max_connections = 64;
    c->metrics_http.idle_timeout_s = 10;
    c->recalibration.kl_threshold = 0.0;
    c->recalibration.min_positions = 2048;
    c->recalibration.n_texts = 0;
    c->recalibration.context = -1;
    c->recalibration.seed_tokens = 256;
    c->recalibration.continue_tokens = 64;
    c->recalibration.out_dir[0] = 0;
    c->kl_sample_rate = 0.0;
    c->weight_update_idle_s = 120.0;
    c->log_stats_interval_s = 10.0;
    c->nccl_timeout_s = 30.0;
    c->sampling.params = (fr_sampling_params){.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 0};
    c->sampling.max_tokens = 256;
    c->sampling.n_stop = 0;
}

void fr_serve_config_engine_opts(const fr_serve_config *c, fr_engine_opts *o)
{
    fr_engine_opts_default(o);
    o->model = c->model;
    o->backend = c->backend;
    o->kv = c->kv_dtype;
    o->compute = c->fp4_compute;
    o->recipe = c->recipe;
    o->calib = c->calib[0] ? c->calib : NULL;
    o->chunk = c->chunk;
    o->max_model_len = c->max_model_len;
    o->tp = c->tp;   /* the caller sets o->group (app/tp_launch.h) */
    o->deterministic = c->deterministic;
}

/* ---- messages ---------------------------------------------------------- */

/* "LABEL: PATH: message" (FR_EINVAL). */
static fr_status bad(const char *label, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static fr_status bad(const char *label, const char *path, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fr_fail(FR_EINVAL, "%s: %s: %s", label, path, msg);
}

static const char *type_name(const cJSON *v)
{
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "an invalid value";
}

static void join_path(char *out, size_t cap, const char *prefix, const char *key)
{
    if (prefix && *prefix) snprintf(out, cap, "%s.%s", prefix, key);
    else snprintf(out, cap, "%s", key);
}

/* Edit distance of two short strings ('-' and '_' count as equal), capped. */
static int distance(const char *a, const char *b)
{
    enum { MAX = 40 };
    size_t la = strlen(a), lb = strlen(b);
    if (la >= MAX || lb >= MAX) return MAX;
    int row[MAX + 1];
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            char ca = a[i - 1] == '-' ? '_' : a[i - 1], cb = b[j - 1] == '-' ? '_' : b[j - 1];
            int sub = diag + (ca != cb), del = row[j] + 1, ins = row[j - 1] + 1;
            diag = row[j];
            row[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
    }
    return row[lb];
}

/* The known key nearest to `key`, or NULL when none is near: one that
 * `key` begins ("kv" for "kv_dtype"), else one within two edits (one for
 * keys of up to three letters). */
static const char *nearest(const char *key, const char *const *names, int n)
{
    const size_t len = strlen(key);
    if (len >= 2)
        for (int i = 0; i < n; i++)
            if (strncmp(key, names[i], len) == 0) return names[i];
    const char *best = NULL;
    int best_d = len >= 4 ? 3 : 2;
    for (int i = 0; i < n; i++) {
        int d = distance(key, names[i]);
        if (d < best_d) {
            best_d = d;
            best = names[i];
        }
    }
    return best;
}

/* Every member of obj must be a known key, given once. */
static fr_status check_keys(const char *label, const cJSON *obj, const char *prefix, const char *const *names,
                            int n)
{
    for (const cJSON *it = obj->child; it; it = it->next) {
        char path[256], near[256];
        join_path(path, sizeof path, prefix, it->string ? it->string : "");
        int known = 0;
        for (int i = 0; i < n && !known; i++) known = strcmp(it->string, names[i]) == 0;
        if (!known) {
            const char *guess = nearest(it->string, names, n);
            if (guess) {
                join_path(near, sizeof near, prefix, guess);
                return fr_fail(FR_EINVAL, "%s: unknown key \"%s\" (did you mean \"%s\"?)", label, path, near);
            }
            return fr_fail(FR_EINVAL, "%s: unknown key \"%s\" (configs/README.md lists every key)", label, path);
        }
        for (const cJSON *prev = obj->child; prev != it; prev = prev->next)
            if (strcmp(prev->string, it->string) == 0)
                return fr_fail(FR_EINVAL, "%s: key \"%s\" is given twice", label, path);
    }
    return FR_OK;
}

/* ---- typed values ------------------------------------------------------ */

static fr_status get_int(const char *label, const cJSON *v, const char *path, long lo, long hi, int *out)
{
    if (!cJSON_IsNumber(v))
        return bad(label, path, "expected an integer in [%ld, %ld], got %s", lo, hi, type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return bad(label, path, "expected an integer in [%ld, %ld], got %g", lo, hi, d);
    if (d < (double)lo || d > (double)hi)
        return bad(label, path, "must be in [%ld, %ld], got %.0f", lo, hi, d);
    *out = (int)d;
    return FR_OK;
}

/* A number in [lo, hi], or (lo, hi] when lo_open. */
static fr_status get_num(const char *label, const cJSON *v, const char *path, double lo, double hi, int lo_open,
                         double *out)
{
    const char open = lo_open ? '(' : '[';
    if (!cJSON_IsNumber(v))
        return bad(label, path, "expected a number in %c%g, %g], got %s", open, lo, hi, type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d < lo || d > hi || (lo_open && d == lo))
        return bad(label, path, "must be in %c%g, %g], got %g", open, lo, hi, d);
    *out = d;
    return FR_OK;
}

/* A non-empty string that fits cap; null gives "" when allow_null. */
static fr_status get_str(const char *label, const cJSON *v, const char *path, char *out, size_t cap,
                         int allow_null)
{
    if (allow_null && cJSON_IsNull(v)) {
        out[0] = '\0';
        return FR_OK;
    }
    if (!cJSON_IsString(v))
        return bad(label, path, "expected a string%s, got %s", allow_null ? " or null" : "", type_name(v));
    size_t n = strlen(v->valuestring);
    if (n == 0) return bad(label, path, "must not be empty%s", allow_null ? " (use null for none)" : "");
    if (n >= cap) return bad(label, path, "is %zu bytes long; at most %zu", n, cap - 1);
    memcpy(out, v->valuestring, n + 1);
    return FR_OK;
}

/* A string handed to one of the project's own parsers (kv dtype, ...). */
static fr_status get_named(const char *label, const cJSON *v, const char *path,
                           fr_status (*parse)(const char *, void *), void *out)
{
    if (!cJSON_IsString(v)) return bad(label, path, "expected a string, got %s", type_name(v));
    if (parse(v->valuestring, out) == FR_OK) return FR_OK;
    char why[512];
    snprintf(why, sizeof why, "%s", fr_last_error());
    return bad(label, path, "%s", why);
}

static fr_status parse_kv(const char *s, void *out) { return fr_kv_dtype_parse(s, out); }
static fr_status parse_compute(const char *s, void *out) { return fr_fp4_compute_parse(s, out); }
static fr_status parse_recipe(const char *s, void *out) { return fr_recipe_parse(s, out); }
static fr_status parse_backend(const char *s, void *out)
{
    fr_backend *b = out;
    if (strcmp(s, "auto") == 0) *b = FR_BACKEND_AUTO;
    else if (strcmp(s, "cpu") == 0) *b = FR_BACKEND_CPU;
    else if (strcmp(s, "cuda") == 0) *b = FR_BACKEND_CUDA;
    else return fr_fail(FR_EINVAL, "unknown backend '%s' (expected auto, cpu or cuda)", s);
    return FR_OK;
}

/* ---- objects ----------------------------------------------------------- */

static fr_status want_object(const char *label, const cJSON *v, const char *path)
{
    return cJSON_IsObject(v) ? FR_OK : bad(label, path, "expected an object, got %s", type_name(v));
}

static fr_status parse_coordinator(const char *label, const cJSON *obj, fr_serve_config *c)
{
    fr_status st = want_object(label, obj, "coordinator");
    if (!st) st = check_keys(label, obj, "coordinator", coordinator_keys, COUNT(coordinator_keys));
    for (const cJSON *it = obj->child; it && !st; it = it->next) {
        char path[128];
        join_path(path, sizeof path, "coordinator", it->string);
        const char *k = it->string;
        if (strcmp(k, "bind") == 0) {
            st = get_str(label, it, path, c->coordinator.bind, sizeof c->coordinator.bind, 0);
            if (!st && strstr(c->coordinator.bind, "://"))
                st = bad(label, path, "give the host or interface only (e.g. \"127.0.0.1\" or \"*\"), not a URL");
        } else if (strcmp(k, "port") == 0) {
            st = get_int(label, it, path, 1, 65535, &c->coordinator.port);
        } else if (strcmp(k, "weight_port") == 0) {
            st = get_int(label, it, path, 1, 65535, &c->coordinator.weight_port);
        } else if (strcmp(k, "engine_port") == 0) {
            st = get_int(label, it, path, 1, 65535, &c->coordinator.engine_port);
        } else if (strcmp(k, "heartbeat_ms") == 0) {
            st = get_int(label, it, path, 0, 3600000, &c->coordinator.heartbeat_ms);
        } else if (strcmp(k, "heartbeat_timeout_ms") == 0) {
            st = get_int(label, it, path, 1, 3600000, &c->coordinator.heartbeat_timeout_ms);
        } else if (strcmp(k, "max_message_bytes") == 0) {
            st = get_int(label, it, path, 65536, INT_MAX, &c->coordinator.max_message_bytes);
        } else if (strcmp(k, "rank_timeout_s") == 0) {
            st = get_int(label, it, path, 0, 86400, &c->coordinator.rank_timeout_s);
        }
    }
    return st;
}

/* The metrics endpoint's limits (docs/metrics.md, "Limits"). */
static fr_status parse_metrics_http(const char *label, const cJSON *obj, fr_serve_config *c)
{
    fr_status st = want_object(label, obj, "metrics_http");
    if (!st) st = check_keys(label, obj, "metrics_http", metrics_http_keys, COUNT(metrics_http_keys));
    for (const cJSON *it = obj->child; it && !st; it = it->next) {
        char path[128];
        join_path(path, sizeof path, "metrics_http", it->string);
        if (strcmp(it->string, "max_connections") == 0)
            st = get_int(label, it, path, 1, 4096, &c->metrics_http.max_connections);
        else if (strcmp(it->string, "idle_timeout_s") == 0)
            st = get_int(label, it, path, 1, 3600, &c->metrics_http.idle_timeout_s);
        else st = get_str(label, it, path, c->metrics_http.token, sizeof c->metrics_http.token, 1);
    }
    return st;
}

static fr_status parse_sampling(const char *label, const cJSON *obj, fr_serve_config *c)
{
    fr_status st = want_object(label, obj, "sampling");
    if (!st) st = check_keys(label, obj, "sampling", sampling_keys, COUNT(sampling_keys));
    fr_serve_sampling *s = &c->sampling;
    for (const cJSON *it = obj->child; it && !st; it = it->next) {
        char path[128];
        join_path(path, sizeof path, "sampling", it->string);
        const char *k = it->string;
        double d = 0;
        if (strcmp(k, "temperature") == 0) {
            if (!(st = get_num(label, it, path, 0.0, 1e6, 0, &d))) s->params.temperature = (float)d;
        } else if (strcmp(k, "top_k") == 0) {
            st = get_int(label, it, path, 0, 1 << 30, &s->params.top_k);
        } else if (strcmp(k, "top_p") == 0) {
            if (!(st = get_num(label, it, path, 0.0, 1.0, 1, &d))) s->params.top_p = (float)d;
        } else if (strcmp(k, "max_tokens") == 0) {
            st = get_int(label, it, path, 1, 1 << 20, &s->max_tokens);
        } else if (strcmp(k, "seed") == 0) {
            /* JSON numbers hold integers exactly up to 2^53; null: seeds from the operating system. */
            if (cJSON_IsNull(it))
                s->has_seed = 0;
            else if (!cJSON_IsNumber(it))
                st = bad(label, path, "expected an integer in [0, 2^53], got %s", type_name(it));
            else if (it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
                     it->valuedouble > 9007199254740992.0)
                st = bad(label, path, "expected an integer in [0, 2^53], got %g", it->valuedouble);
            else
                s->has_seed = 1, s->params.seed = (uint64_t)it->valuedouble;
        } else if (strcmp(k, "stop_token_ids") == 0) {
            if (!cJSON_IsArray(it)) {
                st = bad(label, path, "expected an array of token ids, got %s", type_name(it));
                break;
            }
            int n = cJSON_GetArraySize(it);
            if (n > FR_SERVE_MAX_STOP_IDS) {
                st = bad(label, path, "has %d ids; at most %d", n, FR_SERVE_MAX_STOP_IDS);
                break;
            }
            int i = 0;
            for (const cJSON *e = it->child; e && !st; e = e->next, i++) {
                char epath[160];
                snprintf(epath, sizeof epath, "%s[%d]", path, i);
                st = get_int(label, e, epath, 0, 1 << 30, &s->stop_token_ids[i]);
            }
            if (!st) s->n_stop = n;
        }
    }
    return st;
}

/* Keys given in the file, for the checks across keys. */
/* A CURVE key: 40 characters of ZeroMQ's Z85 alphabet. */
static fr_status get_curve_key(const char *label, const cJSON *v, const char *path, char *out)
{
    static const char z85[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
    if (!cJSON_IsString(v)) return bad(label, path, "expected a CURVE key (40 Z85 characters), got %s", type_name(v));
    size_t n = strlen(v->valuestring);
    if (n != 40 || strspn(v->valuestring, z85) != 40)
        return bad(label, path, "expected a CURVE key of 40 Z85 characters (fp4rollout-client keygen makes one)");
    memcpy(out, v->valuestring, 41);
    return FR_OK;
}

static fr_status parse_curve(const char *label, const cJSON *obj, fr_serve_config *c)
{
    fr_status st = want_object(label, obj, "curve");
    if (!st) st = check_keys(label, obj, "curve", curve_keys, COUNT(curve_keys));
    for (const cJSON *it = obj->child; it && !st; it = it->next) {
        char path[256];
        join_path(path, sizeof path, "curve", it->string);
        if (strcmp(it->string, "server_secret_key") == 0) {
            if (cJSON_IsNull(it)) c->curve.server_secret_key[0] = 0;
            else st = get_curve_key(label, it, path, c->curve.server_secret_key);
        } else {
            if (!cJSON_IsArray(it)) {
                st = bad(label, path, "expected an array of CURVE public keys, got %s", type_name(it));
                break;
            }
            int n = cJSON_GetArraySize(it);
            if (n > FR_SERVE_MAX_CURVE_CLIENTS) {
                st = bad(label, path, "has %d keys; at most %d", n, FR_SERVE_MAX_CURVE_CLIENTS);
                break;
            }
            const int trainers = strcmp(it->string, "trainer_public_keys") == 0;
            int *count = trainers ? &c->curve.n_trainers : &c->curve.n_clients;
            char(*keys)[FR_SERVE_CURVE_KEY] = trainers ? c->curve.trainer_public_keys : c->curve.client_public_keys;
            *count = 0;
            for (int i = 0; i < n && !st; i++) {
                char epath[280];
                snprintf(epath, sizeof epath, "%s[%d]", path, i);
                st = get_curve_key(label, cJSON_GetArrayItem(it, i), epath, keys[i]);
                if (!st) *count = i + 1;
            }
        }
    }
    if (!st && c->curve.server_secret_key[0] && c->curve.n_clients + c->curve.n_trainers == 0)
        st = bad(label, "curve", "a server_secret_key needs at least one key in client_public_keys (only listed "
                                 "clients may connect) or trainer_public_keys");
    if (!st && !c->curve.server_secret_key[0] && c->curve.n_trainers > 0)
        st = bad(label, "curve", "trainer_public_keys needs a server_secret_key");
    if (!st && !c->curve.server_secret_key[0] && c->curve.n_clients > 0)
        st = bad(label, "curve", "client_public_keys needs a server_secret_key");
    return st;
}

static fr_status parse_recalibration(const char *label, const cJSON *obj, fr_serve_config *c)
{
    fr_status st = want_object(label, obj, "recalibration");
    if (!st) st = check_keys(label, obj, "recalibration", recal_keys, COUNT(recal_keys));
    fr_serve_recal *r = &c->recalibration;
    for (const cJSON *it = obj->child; it && !st; it = it->next) {
        char path[256];
        join_path(path, sizeof path, "recalibration", it->string);
        const char *k = it->string;
        if (strcmp(k, "kl_threshold") == 0) st = get_num(label, it, path, 0.0, 1e6, 1, &r->kl_threshold);
        else if (strcmp(k, "after_commit") == 0) {
            if (!cJSON_IsBool(it)) st = bad(label, path, "expected true or false, got %s", type_name(it));
            else r->after_commit = cJSON_IsTrue(it);
        } else if (strcmp(k, "min_positions") == 0) st = get_int(label, it, path, 1, 1 << 30, &r->min_positions);
        else if (strcmp(k, "context") == 0) st = get_int(label, it, path, 0, 1 << 24, &r->context);
        else if (strcmp(k, "seed_tokens") == 0) st = get_int(label, it, path, 1, 1 << 20, &r->seed_tokens);
        else if (strcmp(k, "continue") == 0) st = get_int(label, it, path, 0, 1 << 20, &r->continue_tokens);
        else if (strcmp(k, "out_dir") == 0) st = get_str(label, it, path, r->out_dir, sizeof r->out_dir, 1);
        else {
            if (!cJSON_IsArray(it)) {
                st = bad(label, path, "expected an array of text files, got %s", type_name(it));
                break;
            }
            int n = cJSON_GetArraySize(it);
            if (n < 1 || n > FR_SERVE_MAX_RECAL_TEXTS) {
                st = bad(label, path, "has %d files; give 1 to %d", n, FR_SERVE_MAX_RECAL_TEXTS);
                break;
            }
            r->n_texts = 0;
            for (int i = 0; i < n && !st; i++) {
                char epath[280];
                snprintf(epath, sizeof epath, "%s[%d]", path, i);
                st = get_str(label, cJSON_GetArrayItem(it, i), epath, r->texts[i], sizeof r->texts[i], 0);
                if (!st) r->n_texts = i + 1;
            }
        }
    }
    const int on = r->kl_threshold > 0 || r->after_commit;
    if (!st && on && r->n_texts == 0)
        st = bad(label, "recalibration", "needs texts (the seed texts calibration runs on)");
    if (!st && !on && obj->child)
        st = bad(label, "recalibration", "give kl_threshold (the mean KL in nats above which the key mean is "
                                         "recalibrated), after_commit true, or both");
    return st;
}

typedef struct {
    int kv_blocks, kv_memory_fraction;
} given_keys;

static fr_status parse_top(const char *label, const cJSON *root, fr_serve_config *c, given_keys *given)
{
    fr_status st = check_keys(label, root, "", top_keys, COUNT(top_keys));
    for (const cJSON *it = root->child; it && !st; it = it->next) {
        const char *k = it->string;
        if (strcmp(k, "model") == 0) st = get_str(label, it, k, c->model, sizeof c->model, 0);
        else if (strcmp(k, "backend") == 0) st = get_named(label, it, k, parse_backend, &c->backend);
        else if (strcmp(k, "tp") == 0) st = get_int(label, it, k, 1, 1024, &c->tp);
        else if (strcmp(k, "kv_dtype") == 0) st = get_named(label, it, k, parse_kv, &c->kv_dtype);
        else if (strcmp(k, "fp4_compute") == 0) st = get_named(label, it, k, parse_compute, &c->fp4_compute);
        else if (strcmp(k, "recipe") == 0) st = get_named(label, it, k, parse_recipe, &c->recipe);
        else if (strcmp(k, "calib") == 0) st = get_str(label, it, k, c->calib, sizeof c->calib, 1);
        else if (strcmp(k, "max_seqs") == 0) st = get_int(label, it, k, 1, 1 << 16, &c->max_seqs);
        else if (strcmp(k, "kv_blocks") == 0) {
            st = get_int(label, it, k, 0, 1 << 30, &c->kv_blocks);
            given->kv_blocks = 1;
        } else if (strcmp(k, "kv_memory_fraction") == 0) {
            st = get_num(label, it, k, 0.0, 1.0, 1, &c->kv_memory_fraction);
            given->kv_memory_fraction = 1;
        } else if (strcmp(k, "chunk") == 0) st = get_int(label, it, k, 1, 1 << 20, &c->chunk);
        else if (strcmp(k, "max_model_len") == 0) st = get_int(label, it, k, 0, 1 << 30, &c->max_model_len);
        else if (strcmp(k, "deterministic") == 0) {
            if (!cJSON_IsBool(it)) st = bad(label, k, "expected true or false, got %s", type_name(it));
            else c->deterministic = cJSON_IsTrue(it);
        }
        else if (strcmp(k, "coordinator") == 0) st = parse_coordinator(label, it, c);
        else if (strcmp(k, "metrics_port") == 0) {
            st = get_int(label, it, k, 0, 65535, &c->metrics_port);
            c->metrics_port_default = 0;
        }
        else if (strcmp(k, "metrics_pub_port") == 0) st = get_int(label, it, k, 0, 65535, &c->metrics_pub_port);
        else if (strcmp(k, "metrics_log") == 0) st = get_str(label, it, k, c->metrics_log, sizeof c->metrics_log, 1);
        else if (strcmp(k, "metrics_http") == 0) st = parse_metrics_http(label, it, c);
        else if (strcmp(k, "kl_sample_rate") == 0) st = get_num(label, it, k, 0.0, 1.0, 0, &c->kl_sample_rate);
        else if (strcmp(k, "sampling") == 0) st = parse_sampling(label, it, c);
        else if (strcmp(k, "log_stats_interval_s") == 0)
            st = get_num(label, it, k, 0.0, 86400.0, 0, &c->log_stats_interval_s);
        else if (strcmp(k, "weight_update_idle_s") == 0)
            st = get_num(label, it, k, 0.0, 86400.0, 0, &c->weight_update_idle_s);
        else if (strcmp(k, "nccl_timeout_s") == 0)
            st = get_num(label, it, k, 0.1, 86400.0, 0, &c->nccl_timeout_s);
        else if (strcmp(k, "curve") == 0) st = parse_curve(label, it, c);
        else if (strcmp(k, "recalibration") == 0) st = parse_recalibration(label, it, c);
    }
    return st;
}

/* Settings that are each valid but contradict one another. */
static fr_status check_across(const char *label, const fr_serve_config *c, const given_keys *given)
{
    if (given->kv_memory_fraction && given->kv_blocks && c->kv_blocks > 0)
        return fr_fail(FR_EINVAL,
                       "%s: kv_blocks (%d) and kv_memory_fraction are alternatives: give one of them "
                       "(kv_blocks 0 means sized by kv_memory_fraction)",
                       label, c->kv_blocks);
    if (given->kv_memory_fraction && c->backend == FR_BACKEND_CPU)
        return fr_fail(FR_EINVAL,
                       "%s: kv_memory_fraction sizes the KV cache in GPU memory; with backend \"cpu\" "
                       "give kv_blocks instead",
                       label);
    if ((c->recalibration.kl_threshold > 0 || c->recalibration.after_commit) && c->tp > 1)
        return fr_fail(FR_EINVAL, "%s: recalibration needs tp 1 (each engine one rank); tp is %d", label, c->tp);
    if (c->metrics_log[0] && c->metrics_port == 0)
        return fr_fail(FR_EINVAL, "%s: metrics_log records the history the metrics endpoint keeps: set metrics_port too "
                                  "(it is 0: off)",
                       label);
    const struct { const char *name; int port; } ports[] = {
        {"coordinator.port", c->coordinator.port},
        {"coordinator.weight_port", c->coordinator.weight_port},
        {"coordinator.engine_port", c->coordinator.engine_port},
        {"metrics_port", c->metrics_port_default ? 0 : c->metrics_port},   /* the default gives way */
        {"metrics_pub_port", c->metrics_pub_port},
    };
    const int n_ports = (int)(sizeof ports / sizeof ports[0]);
    for (int a = 0; a < n_ports; a++)
        for (int b = a + 1; b < n_ports; b++)
            if (ports[a].port != 0 && ports[a].port == ports[b].port)
                return fr_fail(FR_EINVAL, "%s: %s and %s are both %d: each socket needs its own port", label,
                               ports[a].name, ports[b].name, ports[a].port);
    return FR_OK;
}

/* Line and column (from 1) of byte offset pos. */
static void line_col(const char *text, size_t pos, int *line, int *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < pos; i++) {
        if (text[i] == '\n') {
            (*line)++;
            *col = 1;
        } else {
            (*col)++;
        }
    }
}

fr_status fr_serve_config_parse(const char *text, size_t len, const char *label, fr_serve_config *c)
{
    if (!label) label = "(config)";
    if (!text || !c) return fr_fail(FR_EINVAL, "%s: no configuration text", label);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root) {
        size_t pos = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        int line, col;
        line_col(text, pos, &line, &col);
        return fr_fail(FR_EFORMAT, "%s: not valid JSON (line %d, column %d)", label, line, col);
    }
    size_t pos = (size_t)(end - text);
    while (pos < len && (text[pos] == ' ' || text[pos] == '\t' || text[pos] == '\n' || text[pos] == '\r' ||
                         text[pos] == '\0'))
        pos++;
    fr_status st = FR_OK;
    if (pos < len) {
        int line, col;
        line_col(text, pos, &line, &col);
        st = fr_fail(FR_EFORMAT, "%s: unexpected text after the JSON object (line %d, column %d)", label, line,
                     col);
    } else if (!cJSON_IsObject(root)) {
        st = fr_fail(FR_EFORMAT, "%s: the configuration must be a JSON object, got %s", label, type_name(root));
    }
    fr_serve_config t = *c;
    given_keys given = {0};
    if (!st) st = parse_top(label, root, &t, &given);
    if (!st) st = check_across(label, &t, &given);
    cJSON_Delete(root);
    if (!st) *c = t;
    return st;
}

/* Makes a relative path p relative to the folder dir (no change when dir
 * is NULL: the file is in the working directory). */
static fr_status rebase(char *p, size_t cap, const char *dir, const char *label, const char *key)
{
    if (!dir || !p[0] || p[0] == '/' || strncmp(p, FR_SYNTHETIC_PREFIX, strlen(FR_SYNTHETIC_PREFIX)) == 0)
        return FR_OK;
    char joined[FR_SERVE_PATH_MAX];
    const char *sep = dir[strlen(dir) - 1] == '/' ? "" : "/";
    int n = snprintf(joined, sizeof joined, "%s%s%s", dir, sep, p);
    if (n < 0 || (size_t)n >= cap || (size_t)n >= sizeof joined)
        return fr_fail(FR_EINVAL, "%s: %s: the path relative to the file's folder is too long", label, key);
    memcpy(p, joined, (size_t)n + 1);
    return FR_OK;
}

fr_status fr_serve_config_load(const char *path, fr_serve_config *c)
{
    if (!path || !c) return fr_fail(FR_EINVAL, "fr_serve_config_load: path or config is NULL");
    FILE *f = fopen(path, "rb");
    if (!f) return fr_fail(FR_EIO, "cannot read config file %s: %s", path, strerror(errno));
    enum { LIMIT = 1 << 20 };
    char *buf = malloc(LIMIT + 1);
    if (!buf) {
        fclose(f);
        return fr_fail(FR_ENOMEM, "%s: out of memory", path);
    }
    size_t n = fread(buf, 1, LIMIT + 1, f);
    int err = ferror(f);
    fclose(f);
    fr_status st = FR_OK;
    if (err) st = fr_fail(FR_EIO, "cannot read config file %s", path);
    else if (n > LIMIT) st = fr_fail(FR_EFORMAT, "%s: larger than %d bytes; not a configuration", path, LIMIT);
    fr_serve_config t = *c;
    if (!st) st = fr_serve_config_parse(buf, n, path, &t);
    free(buf);
    if (st) return st;
    /* The file's folder: "dir/x.json" -> "dir", "/x.json" -> "/", "x.json" -> none. */
    char dir[FR_SERVE_PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (slash) {
        size_t dl = slash == path ? 1 : (size_t)(slash - path);
        if (dl >= sizeof dir) return fr_fail(FR_EINVAL, "%s: path too long", path);
        memcpy(dir, path, dl);
        dir[dl] = '\0';
    }
    if ((st = rebase(t.model, sizeof t.model, slash ? dir : NULL, path, "model"))) return st;
    if ((st = rebase(t.calib, sizeof t.calib, slash ? dir : NULL, path, "calib"))) return st;
    for (int i = 0; i < t.recalibration.n_texts; i++)
        if ((st = rebase(t.recalibration.texts[i], sizeof t.recalibration.texts[i], slash ? dir : NULL, path,
                         "recalibration.texts")))
            return st;
    if ((st = rebase(t.recalibration.out_dir, sizeof t.recalibration.out_dir, slash ? dir : NULL, path,
                     "recalibration.out_dir")))
        return st;
    if ((st = rebase(t.metrics_log, sizeof t.metrics_log, slash ? dir : NULL, path, "metrics_log"))) return st;
    *c = t;
    return FR_OK;
}

fr_status fr_serve_config_to_json(const fr_serve_config *c, char **json)
{
    if (!c || !json) return fr_fail(FR_EINVAL, "fr_serve_config_to_json: config or output is NULL");
    *json = NULL;
    char recipe[128];
    fr_recipe_format(&c->recipe, recipe, sizeof recipe);
    cJSON *root = cJSON_CreateObject(), *co = cJSON_CreateObject(), *sa = cJSON_CreateObject();
    cJSON *stops = cJSON_CreateIntArray(c->sampling.stop_token_ids, c->sampling.n_stop);
    int ok = root && co && sa && stops;
    ok = ok && cJSON_AddStringToObject(root, "model", c->model);
    ok = ok && cJSON_AddStringToObject(root, "backend", fr_backend_name(c->backend));
    ok = ok && cJSON_AddNumberToObject(root, "tp", c->tp);
    ok = ok && cJSON_AddStringToObject(root, "kv_dtype", fr_kv_dtype_name(c->kv_dtype));
    ok = ok && cJSON_AddStringToObject(root, "fp4_compute", fr_fp4_compute_name(c->fp4_compute));
    ok = ok && cJSON_AddStringToObject(root, "recipe", recipe);
    ok = ok && (c->calib[0] ? cJSON_AddStringToObject(root, "calib", c->calib) != NULL
                            : cJSON_AddNullToObject(root, "calib") != NULL);
    ok = ok && cJSON_AddNumberToObject(root, "max_seqs", c->max_seqs);
    ok = ok && cJSON_AddNumberToObject(root, "kv_blocks", c->kv_blocks);
    /* kv_memory_fraction is an alternative to kv_blocks, and GPU-only. */
    if (c->kv_blocks == 0 && c->backend != FR_BACKEND_CPU)
        ok = ok && cJSON_AddNumberToObject(root, "kv_memory_fraction", c->kv_memory_fraction);
    ok = ok && cJSON_AddNumberToObject(root, "chunk", c->chunk);
    ok = ok && cJSON_AddNumberToObject(root, "max_model_len", c->max_model_len);
    ok = ok && cJSON_AddBoolToObject(root, "deterministic", c->deterministic);
    ok = ok && cJSON_AddStringToObject(co, "bind", c->coordinator.bind);
    ok = ok && cJSON_AddNumberToObject(co, "port", c->coordinator.port);
    ok = ok && cJSON_AddNumberToObject(co, "weight_port", c->coordinator.weight_port);
    ok = ok && cJSON_AddNumberToObject(co, "engine_port", c->coordinator.engine_port);
    ok = ok && cJSON_AddNumberToObject(co, "heartbeat_ms", c->coordinator.heartbeat_ms);
    ok = ok && cJSON_AddNumberToObject(co, "heartbeat_timeout_ms", c->coordinator.heartbeat_timeout_ms);
    ok = ok && cJSON_AddNumberToObject(co, "max_message_bytes", c->coordinator.max_message_bytes);
    ok = ok && cJSON_AddNumberToObject(co, "rank_timeout_s", c->coordinator.rank_timeout_s);
    if (ok) {
        cJSON_AddItemToObject(root, "coordinator", co);
        co = NULL;
    }
    if (!c->metrics_port_default) ok = ok && cJSON_AddNumberToObject(root, "metrics_port", c->metrics_port);
    ok = ok && cJSON_AddNumberToObject(root, "metrics_pub_port", c->metrics_pub_port);
    ok = ok && (c->metrics_log[0] ? cJSON_AddStringToObject(root, "metrics_log", c->metrics_log) != NULL
                                  : cJSON_AddNullToObject(root, "metrics_log") != NULL);
    cJSON *mh = ok ? cJSON_CreateObject() : NULL;
    ok = ok && mh && cJSON_AddNumberToObject(mh, "max_connections", c->metrics_http.max_connections) &&
         cJSON_AddNumberToObject(mh, "idle_timeout_s", c->metrics_http.idle_timeout_s) &&
         (c->metrics_http.token[0] ? cJSON_AddStringToObject(mh, "token", c->metrics_http.token) != NULL
                                   : cJSON_AddNullToObject(mh, "token") != NULL);
    if (ok) cJSON_AddItemToObject(root, "metrics_http", mh);
    else cJSON_Delete(mh);
    ok = ok && cJSON_AddNumberToObject(root, "kl_sample_rate", c->kl_sample_rate);
    ok = ok && cJSON_AddNumberToObject(root, "weight_update_idle_s", c->weight_update_idle_s);
    ok = ok && cJSON_AddNumberToObject(root, "log_stats_interval_s", c->log_stats_interval_s);
    ok = ok && cJSON_AddNumberToObject(root, "nccl_timeout_s", c->nccl_timeout_s);
    if (ok && c->curve.server_secret_key[0]) {
        cJSON *cv = cJSON_CreateObject(), *keys = cJSON_CreateArray();
        ok = cv && keys && cJSON_AddStringToObject(cv, "server_secret_key", c->curve.server_secret_key);
        for (int i = 0; ok && i < c->curve.n_clients; i++) {
            cJSON *k = cJSON_CreateString(c->curve.client_public_keys[i]);
            ok = k != NULL;
            if (ok) cJSON_AddItemToArray(keys, k);
        }
        cJSON *tkeys = c->curve.n_trainers && ok ? cJSON_CreateArray() : NULL;
        ok = ok && (tkeys || !c->curve.n_trainers);
        for (int i = 0; ok && i < c->curve.n_trainers; i++) {
            cJSON *k = cJSON_CreateString(c->curve.trainer_public_keys[i]);
            ok = k != NULL;
            if (ok) cJSON_AddItemToArray(tkeys, k);
        }
        if (tkeys && ok) cJSON_AddItemToObject(cv, "trainer_public_keys", tkeys);
        else cJSON_Delete(tkeys);
        if (ok) {
            cJSON_AddItemToObject(cv, "client_public_keys", keys);
            keys = NULL;
            cJSON_AddItemToObject(root, "curve", cv);
            cv = NULL;
        }
        cJSON_Delete(keys);
        cJSON_Delete(cv);
    }
    if (ok && (c->recalibration.kl_threshold > 0 || c->recalibration.after_commit)) {
        const fr_serve_recal *r = &c->recalibration;
        cJSON *rc = cJSON_CreateObject(), *texts = cJSON_CreateArray();
        ok = rc && texts && (r->kl_threshold > 0 ? cJSON_AddNumberToObject(rc, "kl_threshold", r->kl_threshold) != NULL
                                                 : 1) &&
             cJSON_AddBoolToObject(rc, "after_commit", r->after_commit) &&
             cJSON_AddNumberToObject(rc, "min_positions", r->min_positions);
        for (int i = 0; ok && i < r->n_texts; i++) {
            cJSON *t = cJSON_CreateString(r->texts[i]);
            ok = t != NULL;
            if (ok) cJSON_AddItemToArray(texts, t);
        }
        if (ok) {
            cJSON_AddItemToObject(rc, "texts", texts);
            texts = NULL;
        }
        if (r->context >= 0) ok = ok && cJSON_AddNumberToObject(rc, "context", r->context);   /* else the default */
        ok = ok && cJSON_AddNumberToObject(rc, "seed_tokens", r->seed_tokens);
        ok = ok && cJSON_AddNumberToObject(rc, "continue", r->continue_tokens);
        ok = ok && (r->out_dir[0] ? cJSON_AddStringToObject(rc, "out_dir", r->out_dir) != NULL
                                  : cJSON_AddNullToObject(rc, "out_dir") != NULL);
        if (ok) {
            cJSON_AddItemToObject(root, "recalibration", rc);
            rc = NULL;
        }
        cJSON_Delete(texts);
        cJSON_Delete(rc);
    }
    ok = ok && cJSON_AddNumberToObject(sa, "temperature", c->sampling.params.temperature);
    ok = ok && cJSON_AddNumberToObject(sa, "top_k", c->sampling.params.top_k);
    ok = ok && cJSON_AddNumberToObject(sa, "top_p", c->sampling.params.top_p);
    ok = ok && cJSON_AddNumberToObject(sa, "max_tokens", c->sampling.max_tokens);
    if (ok) {
        cJSON_AddItemToObject(sa, "stop_token_ids", stops);
        stops = NULL;
    }
    ok = ok && (c->sampling.has_seed ? cJSON_AddNumberToObject(sa, "seed", (double)c->sampling.params.seed)
                                     : cJSON_AddNullToObject(sa, "seed")) != NULL;
    if (ok) {
        cJSON_AddItemToObject(root, "sampling", sa);
        sa = NULL;
    }
    char *text = ok ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    cJSON_Delete(co);
    cJSON_Delete(sa);
    cJSON_Delete(stops);
    if (!text) return fr_fail(FR_ENOMEM, "fr_serve_config_to_json: out of memory");
    /* cJSON's allocator is malloc unless changed: the caller frees with free(). */
    *json = text;
    return FR_OK;
}
