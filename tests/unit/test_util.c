#include "test_util.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <string.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <pthread.h>
#include <signal.h>

#include "rollout/engine/session.h"
#include "trainer_bridge/server/server.h"

/* FR_<NAME>_DIR, the variable that points at checkpoint `name`. */
static void dir_variable(const char *name, char *var, size_t cap)
{
    size_t n = (size_t)snprintf(var, cap, "FR_");
    for (const char *c = name; *c && n + 5 < cap; c++) var[n++] = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
    snprintf(var + n, cap - n, "_DIR");
}

/* 1 when dir holds a model folder (its config.json). */
static int has_config(const char *dir)
{
    char probe[4200];
    struct stat st;
    snprintf(probe, sizeof probe, "%s/config.json", dir);
    return stat(probe, &st) == 0;
}

/* The DeepSeek test checkpoints are small enough to live in the repository:
 * "models/dsmoe/", where name is one of them, else NULL. */
static const char *repo_copy_folder(const char *name) { return strncmp(name, "dsmoe", 5) == 0 ? "models/dsmoe/" : NULL; }

const char *fr_test_model_dir(const char *name)
{
    char var[64];
    dir_variable(name, var, sizeof var);
    const char *env = getenv(var);
    static char dir[4096];
    if (env && *env) {   /* a variable that points nowhere is not overridden */
        snprintf(dir, sizeof dir, "%s", env);
        return has_config(dir) ? dir : NULL;
    }
    snprintf(dir, sizeof dir, "../shared/models/%s", name);
    if (has_config(dir)) return dir;
    const char *repo = repo_copy_folder(name);
    if (!repo) return NULL;
    snprintf(dir, sizeof dir, "%s%s", repo, name);
    return has_config(dir) ? dir : NULL;
}

const char *fr_test_require_model(const char *name)
{
    const char *dir = fr_test_model_dir(name);
    if (!dir) {
        char var[64];
        dir_variable(name, var, sizeof var);
        const char *repo = repo_copy_folder(name);
        fprintf(stderr, "SKIP: %s checkpoint not found (set %s or place it at ../shared/models/%s%s%s%s)\n", name, var,
                name, repo ? " or " : "", repo ? repo : "", repo ? name : "");
    }
    return dir;
}

const char *fr_test_tq6_dir(void) { return fr_test_model_dir("tq6"); }

const char *fr_test_require_tq6(void) { return fr_test_require_model("tq6"); }

uint64_t fr_test_u64(fr_test_rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float fr_test_uniform(fr_test_rng *r) { return (float)(fr_test_u64(r) >> 40) * 0x1p-24f; }

float fr_test_normal(fr_test_rng *r)
{
    float u1 = fr_test_uniform(r), u2 = fr_test_uniform(r);
    if (u1 < 1e-12f) u1 = 1e-12f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

void fr_test_clear_dir(const char *dir, int remove_self)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[4096];
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
    closedir(d);
    if (remove_self) rmdir(dir);
}

struct fr_test_server {
    fr_session sess;
    fr_bridge_server *srv;
    pthread_t thread;
    volatile sig_atomic_t stop;
    fr_status run_status;
    FILE *log;
};

static void *serve_loop(void *arg)
{
    fr_test_server *l = arg;
    l->run_status = fr_bridge_server_run(l->srv, &l->stop);
    return NULL;
}

fr_status fr_test_server_start(const char *spec, int kv_blocks, int max_seqs, int max_tokens, fr_test_server **out)
{
    return fr_test_server_start_det(spec, kv_blocks, max_seqs, max_tokens, 0, out);
}

fr_status fr_test_server_start_det(const char *spec, int kv_blocks, int max_seqs, int max_tokens, int deterministic,
                                   fr_test_server **out)
{
    *out = NULL;
    fr_test_server *l = calloc(1, sizeof *l);
    if (!l) return fr_fail(FR_ENOMEM, "test server: out of memory");
    fr_engine_opts o;
    fr_engine_opts_default(&o);
    o.model = spec;
    o.backend = FR_BACKEND_CPU;
    o.deterministic = deterministic;
    fr_status st = fr_session_open(&o, kv_blocks, max_seqs, &l->sess);
    if (st) {
        free(l);
        return st;
    }
    l->log = fopen("/dev/null", "w");
    fr_bridge_config cfg = {.endpoint = "tcp://127.0.0.1:*", .model_name = spec, .max_seqs = max_seqs,
                            .sampling = {.params = {.temperature = 0, .top_k = 0, .top_p = 1}, .max_tokens = max_tokens},
                            .shutdown_linger_ms = 1000, .stats_log_ms = -1, .log = l->log};
    if (!l->log) st = fr_fail(FR_EIO, "test server: cannot open /dev/null");
    if (!st) st = fr_bridge_server_new(&l->sess, &cfg, &l->srv);
    if (!st && pthread_create(&l->thread, NULL, serve_loop, l)) st = fr_fail(FR_EIO, "test server: no thread");
    if (st) {
        fr_bridge_server_destroy(&l->srv);
        fr_session_close(&l->sess);
        if (l->log) fclose(l->log);
        free(l);
        return st;
    }
    *out = l;
    return FR_OK;
}

const char *fr_test_server_endpoint(const fr_test_server *l) { return fr_bridge_server_endpoint(l->srv); }

fr_status fr_test_server_stop(fr_test_server **pl)
{
    fr_test_server *l = *pl;
    if (!l) return FR_OK;
    l->stop = 1;
    pthread_join(l->thread, NULL);
    const fr_status st = l->run_status;
    fr_bridge_server_destroy(&l->srv);
    fr_session_close(&l->sess);
    fclose(l->log);
    free(l);
    *pl = NULL;
    return st;
}

fr_engine_opts fr_test_engine_opts(fr_backend backend, const char *model, fr_kv_dtype kv)
{
    fr_engine_opts o;
    fr_engine_opts_default(&o);
    o.backend = backend;
    if (model) o.model = model;
    o.kv = kv;
    return o;
}

void fr_test_error_has(const char *needle)
{
    if (!strstr(fr_last_error(), needle)) fail_msg("error \"%s\" does not mention \"%s\"", fr_last_error(), needle);
}

void fr_test_round_trip(const fr_msg *m, fr_msg *out, size_t *len)
{
    char *data = NULL;
    size_t n = 0;
    if (fr_msg_encode(m, &data, &n)) fail_msg("encode %s: %s", fr_msg_type_name(m->type), fr_last_error());
    if (fr_msg_decode(data, n, out)) fail_msg("decode %s: %s", fr_msg_type_name(m->type), fr_last_error());
    free(data);
    if (len) *len = n;
    assert_int_equal(out->type, m->type);
}

/* malloc'd copy of n bytes (at least one byte, so that an empty array is
 * not NULL), or NULL when src is. */
static void *copy_of(const void *src, size_t n)
{
    if (!src) return NULL;
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    memcpy(p, src, n);
    return p;
}

void fr_test_keep_result(fr_sample_result *dst, const fr_sample_result *src)
{
    const size_t n = (size_t)src->n_tokens;
    *dst = *src;
    dst->tokens = copy_of(src->tokens, sizeof(int) * n);
    dst->text = copy_of(src->text, src->text_len + 1);   /* may hold NUL: token 0 is a byte */
    dst->routed_experts = copy_of(src->routed_experts, fr_sample_route_bytes(src) * n);
    dst->logprobs = NULL;
    dst->versions = NULL;
    dst->kl = NULL;
    dst->top_ids = NULL;
    dst->top_logprobs = NULL;
    dst->prompt_logprobs = NULL;
}

fr_scheduler *fr_test_scheduler(fr_session *s, int chunk)
{
    fr_scheduler_config c = {.max_seqs = 0, .chunk = chunk, .reserve_blocks = -1};
    fr_scheduler *sch = NULL;
    if (fr_scheduler_new(s, &c, &sch)) fail_msg("scheduler: %s", fr_last_error());
    return sch;
}
