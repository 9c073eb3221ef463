#include "rollout/monitor/eval_kl.h"

#include "base/clock.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout/engine/kl_metrics.h"
#include "rollout/model/runner.h"

/* ---- configuration names ---- */

static const char config_grammar[] =
    "expected bf16, f32, fp8, or nvfp4 / mxfp4 optionally followed by -vanilla, -kv, "
    "-no-X (X: smooth, rotate, search, dual, pscale, sink) and -rowmax (CPU analysis: P "
    "against the row's final maximum)";

fr_status fr_eval_config_parse(const char *name, fr_eval_config *out)
{
    memset(out, 0, sizeof *out);
    if (!name || !*name) return fr_fail(FR_EINVAL, "empty configuration name (%s)", config_grammar);
    if (strlen(name) >= sizeof out->name) return fr_fail(FR_EINVAL, "configuration name '%.60s...' too long", name);
    snprintf(out->name, sizeof out->name, "%s", name);
    out->compute = FR_COMPUTE_EXACT;
    out->recipe = fr_recipe_full();
    static const char *const plain[] = {"bf16", "f32", "fp8"};
    static const fr_kv_dtype plain_kv[] = {FR_KV_BF16, FR_KV_F32, FR_KV_FP8};
    for (int i = 0; i < 3; i++)
        if (strcmp(name, plain[i]) == 0) {
            out->kv = plain_kv[i];
            return FR_OK;
        }
    if (strncmp(name, "nvfp4", 5) == 0) out->kv = FR_KV_NVFP4;
    else if (strncmp(name, "mxfp4", 5) == 0) out->kv = FR_KV_MXFP4;
    else return fr_fail(FR_EINVAL, "unknown configuration '%s' (%s)", name, config_grammar);
    char switches[128] = "";    /* ",-rotate,-search" */
    int vanilla = 0, rowmax = 0;
    const char *p = name + 5;
    while (*p) {
        if (strncmp(p, "-vanilla", 8) == 0 && (p[8] == '-' || !p[8])) {
            vanilla = 1;
            p += 8;
        } else if (strncmp(p, "-rowmax", 7) == 0 && (p[7] == '-' || !p[7])) {
            rowmax = 1;
            p += 7;
        } else if (strncmp(p, "-kv", 3) == 0 && (p[3] == '-' || !p[3])) {
            out->compute = FR_COMPUTE_BF16;
            p += 3;
        } else if (strncmp(p, "-no-", 4) == 0) {
            const char *sw = p + 4, *end = strchr(sw, '-');
            size_t n = end ? (size_t)(end - sw) : strlen(sw), have = strlen(switches);
            if (n == 0 || have + n + 3 > sizeof switches)
                return fr_fail(FR_EINVAL, "unknown configuration '%s' (%s)", name, config_grammar);
            snprintf(switches + have, sizeof switches - have, ",-%.*s", (int)n, sw);
            p = sw + n;
        } else {
            return fr_fail(FR_EINVAL, "unknown configuration '%s' (%s)", name, config_grammar);
        }
    }
    char recipe[160];
    snprintf(recipe, sizeof recipe, "%s%s%s", vanilla ? "vanilla" : "full", switches, rowmax ? ",+rowmax" : "");
    if (fr_recipe_parse(recipe, &out->recipe)) {
        char why[256];
        snprintf(why, sizeof why, "%s", fr_last_error());
        return fr_fail(FR_EINVAL, "configuration '%s': %s", name, why);
    }
    return FR_OK;
}

static int recipe_equal(const fr_recipe *a, const fr_recipe *b) { return memcmp(a, b, sizeof *a) == 0; }

/* "vanilla", "full recipe", or the recipe's parts. */
static void recipe_name(const fr_recipe *rc, char *buf, int len)
{
    fr_recipe van = fr_recipe_vanilla(), full = fr_recipe_full();
    if (recipe_equal(rc, &van)) snprintf(buf, (size_t)len, "vanilla");
    else if (recipe_equal(rc, &full)) snprintf(buf, (size_t)len, "full recipe");
    else fr_recipe_format(rc, buf, len);
}

void fr_eval_config_describe(const fr_eval_config *c, char *buf, int len)
{
    switch (c->kv) {
    case FR_KV_BF16: snprintf(buf, (size_t)len, "BF16 KV (the reference, rerun)"); return;
    case FR_KV_F32: snprintf(buf, (size_t)len, "float32 KV (nothing rounded)"); return;
    case FR_KV_FP8: snprintf(buf, (size_t)len, "FP8 E4M3 KV, per-head scales"); return;
    default: break;
    }
    char r[96];
    recipe_name(&c->recipe, r, (int)sizeof r);
    snprintf(buf, (size_t)len, "%s KV, %s, %s", c->kv == FR_KV_NVFP4 ? "NVFP4" : "MXFP4", r,
             c->compute == FR_COMPUTE_BF16 ? "query and P in BF16" : "FP4 query and P");
}

void fr_eval_config_describe_latent(const fr_eval_config *c, char *buf, int len)
{
    if (c->kv == FR_KV_FP8) {
        snprintf(buf, (size_t)len, "FP8 E4M3 latent, per-layer scale");
        return;
    }
    if (!fr_kv_dtype_is_fp4(c->kv)) {
        fr_eval_config_describe(c, buf, len);
        return;
    }
    char r[96];
    recipe_name(&c->recipe, r, (int)sizeof r);
    snprintf(buf, (size_t)len, "%s latent, %s, %s, P unquantized", c->kv == FR_KV_NVFP4 ? "NVFP4" : "MXFP4", r,
             c->compute == FR_COMPUTE_BF16 ? "query in BF16" : "FP4 query");
}

static const char *const ablation_parts[] = {"smooth", "rotate", "search", "dual", "pscale", "sink"};
enum { N_ABLATION = 6 };

fr_status fr_eval_config_list(const char *list, int ablation, fr_eval_config **out, int *n)
{
    *out = NULL;
    *n = 0;
    if (!list) list = ablation ? "nvfp4" : FR_EVAL_DEFAULT_CONFIGS;
    size_t L = strlen(list);
    char *buf = malloc(L + 1);
    fr_eval_config *cfgs = malloc(sizeof *cfgs * (L + 1) * (N_ABLATION + 1));
    if (!buf || !cfgs) {
        free(buf); free(cfgs);
        return fr_fail(FR_ENOMEM, "out of memory");
    }
    memcpy(buf, list, L + 1);
    fr_status st = FR_OK;
    int count = 0;
    char *p = buf;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma) *comma = 0;
        while (*p == ' ') p++;
        char *e = p + strlen(p);
        while (e > p && e[-1] == ' ') *--e = 0;
        if ((st = fr_eval_config_parse(p, &cfgs[count]))) break;
        count++;
        if (ablation && (strcmp(p, "nvfp4") == 0 || strcmp(p, "mxfp4") == 0))
            for (int i = 0; i < N_ABLATION && !st; i++) {
                char name[48];
                snprintf(name, sizeof name, "%s-no-%s", p, ablation_parts[i]);
                if (!(st = fr_eval_config_parse(name, &cfgs[count]))) count++;
            }
        if (st || !comma) break;
        p = comma + 1;
    }
    free(buf);
    if (st) {
        free(cfgs);
        return st;
    }
    *out = cfgs;
    *n = count;
    return FR_OK;
}

/* ---- statistics ---- */

double fr_paired_t(const double *a, const double *b, long n)
{
    if (n < 2) return NAN;
    double mean = 0.0, ss = 0.0;
    for (long i = 0; i < n; i++) mean += a[i] - b[i];
    mean /= (double)n;
    for (long i = 0; i < n; i++) {
        double d = a[i] - b[i] - mean;
        ss += d * d;
    }
    double sd = sqrt(ss / (double)(n - 1));
    return sd > 0.0 ? mean / (sd / sqrt((double)n)) : NAN;
}

/* ---- the passes ---- */

typedef struct {
    const fr_model *m;
    const fr_eval_kl_params *p;
    const long *off;       /* first position of each text */
    int max_len;
} eval_ctx;

/* Receives the logits of text i at position t. */
typedef fr_status (*row_fn)(void *user, int text, int pos, const float *logits);

/* Runs every text through the decode path of a cache configured by kc, one
 * token of every unfinished text per step. */
static fr_status run_pass(const eval_ctx *e, fr_kv_cache_config kc, const char *label, row_fn fn, void *user)
{
    const fr_eval_kl_params *p = e->p;
    const int V = e->m->cfg.vocab_size, N = p->n_texts;
    kc.n_blocks = 1;
    for (int i = 0; i < N; i++) kc.n_blocks += (p->lens[i] + FR_PAGE_TOKENS - 1) / FR_PAGE_TOKENS;
    kc.max_seqs = N;
    /* On the GPU (device weights) the pages live on the device: the host
     * cache keeps the sequences. */
    kc.bookkeeping_only = p->gpu != NULL;
    fr_kv_cache *kv = NULL;
    fr_runner *r = NULL;
    int *seq = malloc(sizeof(int) * (size_t)N), *text_of = malloc(sizeof(int) * (size_t)N), opened = 0;
    fr_step_seq *steps = malloc(sizeof *steps * (size_t)N);
    float *logits = malloc(sizeof(float) * (size_t)V * N);
    fr_status st = seq && text_of && steps && logits ? FR_OK : fr_fail(FR_ENOMEM, "eval-kl: out of memory");
    if (!st) st = fr_kv_cache_new(&kc, &kv);
    const fr_runner_config rc = {.model = e->m, .gpu = p->gpu, .kv = kv, .max_step_tokens = N, .tp = p->tp,
                                 .deterministic = p->deterministic};
    if (!st) st = fr_runner_open(&rc, &r);
    for (int i = 0; i < N && !st; i++)
        if (!(st = fr_kv_seq_new(kv, &seq[i]))) opened++;
    double t0 = fr_now_s(), shown = t0;
    for (int t = 0; t < e->max_len && !st; t++) {
        int ns = 0;
        for (int i = 0; i < N; i++)
            if (t < p->lens[i]) {
                text_of[ns] = i;
                steps[ns++] = (fr_step_seq){.seq = seq[i], .n = 1, .tokens = p->texts[i] + t, .all_logits = 0};
            }
        const fr_batch b = {.kind = FR_BATCH_STEP, .seqs = steps, .n_seqs = ns, .logits = logits};
        st = fr_runner_run(r, &b);
        for (int j = 0; j < ns && !st; j++) st = fn(user, text_of[j], t, logits + (size_t)j * V);
        if (p->verbose && !st && (fr_now_s() - shown > 10.0 || t + 1 == e->max_len)) {
            fprintf(stderr, "eval-kl: %s: position %d/%d (%.1f s)\n", label, t + 1, e->max_len, fr_now_s() - t0);
            shown = fr_now_s();
        }
    }
    for (int i = 0; i < opened; i++) fr_kv_seq_free(kv, seq[i]);
    fr_runner_destroy(&r);
    fr_kv_cache_destroy(&kv);
    free(seq); free(text_of); free(steps); free(logits);
    return st;
}

typedef struct {
    float *ref;            /* [positions][vocab] */
    const long *off;
    int vocab;
} ref_sink;

static fr_status keep_reference(void *user, int text, int pos, const float *logits)
{
    ref_sink *rs = user;
    memcpy(rs->ref + (size_t)(rs->off[text] + pos) * rs->vocab, logits, sizeof(float) * (size_t)rs->vocab);
    return FR_OK;
}

typedef struct {
    const ref_sink *ref;
    fr_eval_result *res;
} kl_sink;

static fr_status measure(void *user, int text, int pos, const float *logits)
{
    kl_sink *ks = user;
    long at = ks->ref->off[text] + pos;
    fr_kl_result kr;
    fr_status st = fr_kl_topk(ks->ref->ref + (size_t)at * ks->ref->vocab, logits, ks->ref->vocab, FR_KL_TOP_K,
                              -1, &kr);
    if (st) return st;
    ks->res->pos_kl[at] = kr.kl;
    ks->res->text_kl[text] += kr.kl;
    ks->res->text_mismatch[text] += !kr.top1_match;
    return FR_OK;
}

/* A tensor-parallel rank's cache holds its KV heads and their rows of the
 * calibration tables (key_mean and fp8 hold room for the local slices). */
static fr_kv_cache_config cache_config(const fr_model_config *mc, const fr_eval_config *c, const fr_calib *calib,
                                       const fr_tp_layout *tl, float *key_mean, float *fp8)
{
    if (calib && tl->size > 1) {
        fr_tp_slice_kv_table(calib->key_mean, mc->num_layers, mc->num_kv_heads, mc->head_dim, tl, key_mean);
        if (calib->fp8_scales) fr_tp_slice_kv_table(calib->fp8_scales, mc->num_layers, mc->num_kv_heads, 2, tl, fp8);
    }
    const int local = calib && tl->size > 1;
    return (fr_kv_cache_config){
        .n_layers = mc->num_layers, .n_kv_heads = tl->n_kv_heads, .head_dim = mc->head_dim,
        .latent_dim = mc->kv_lora_rank,
        .dtype = c->kv, .compute = c->compute, .recipe = c->recipe,
        .tau = calib && calib->has_tau ? calib->tau : FR_P_TAU,
        .key_mean = !calib ? NULL : local ? key_mean : calib->key_mean,
        .fp8_scales = !calib || !calib->fp8_scales ? NULL : local ? fp8 : calib->fp8_scales,
    };
}

static fr_status check_params(const fr_model *m, const fr_eval_kl_params *p)
{
    if (!p || p->n_texts < 1 || !p->texts || !p->lens) return fr_fail(FR_EINVAL, "eval-kl: no text");
    if (p->n_configs < 1 || !p->configs) return fr_fail(FR_EINVAL, "eval-kl: no configuration");
    if (p->deterministic && p->gpu)
        return fr_fail(FR_EUNSUPPORTED, "eval-kl: deterministic mode runs on the CPU backend only so far "
                       "(docs/determinism.md)");
    for (int i = 0; i < p->n_texts; i++) {
        if (!p->texts[i] || p->lens[i] < 1) return fr_fail(FR_EINVAL, "eval-kl: text %d is empty", i);
        if (p->lens[i] > m->cfg.max_position)
            return fr_fail(FR_EINVAL, "eval-kl: text %d has %d tokens, more than the context window of %d", i,
                           p->lens[i], m->cfg.max_position);
        for (int j = 0; j < p->lens[i]; j++)
            if (p->texts[i][j] < 0 || p->texts[i][j] >= m->cfg.vocab_size)
                return fr_fail(FR_EINVAL, "eval-kl: text %d has id %d outside the vocabulary", i, p->texts[i][j]);
    }
    return FR_OK;
}

static void assign_baselines(fr_eval_kl_report *r)
{
    int first_fp4 = -1;
    for (int c = 0; c < r->n_configs && first_fp4 < 0; c++)
        if (fr_kv_dtype_is_fp4(r->results[c].cfg.kv)) first_fp4 = c;
    for (int c = 0; c < r->n_configs; c++) {
        fr_eval_result *res = &r->results[c];
        res->baseline = first_fp4;
        for (int b = 0; b < r->n_configs; b++)
            if (fr_kv_dtype_is_fp4(r->results[b].cfg.kv) && r->results[b].cfg.kv == res->cfg.kv) {
                res->baseline = b;
                break;
            }
        res->t_text = res->t_pos = NAN;
        if (res->baseline >= 0 && res->baseline != c) {
            const fr_eval_result *b = &r->results[res->baseline];
            res->t_text = fr_paired_t(res->text_kl, b->text_kl, r->n_texts);
            res->t_pos = fr_paired_t(res->pos_kl, b->pos_kl, r->positions);
        }
    }
}

fr_status fr_eval_kl(const fr_model *m, const fr_eval_kl_params *p, fr_eval_kl_report *out)
{
    memset(out, 0, sizeof *out);
    fr_status st = check_params(m, p);
    if (st) return st;
    const int V = m->cfg.vocab_size, N = p->n_texts;
    long *off = malloc(sizeof(long) * (size_t)(N + 1));
    if (!off) return fr_fail(FR_ENOMEM, "eval-kl: out of memory");
    eval_ctx e = {.m = m, .p = p, .off = off, .max_len = 0};
    off[0] = 0;
    for (int i = 0; i < N; i++) {
        off[i + 1] = off[i] + p->lens[i];
        if (p->lens[i] > e.max_len) e.max_len = p->lens[i];
    }
    const long P = off[N];
    const int tp_rank = p->tp ? p->tp->rank : 0, tp_size = p->tp ? p->tp->size : 1;
    fr_tp_layout tl;
    if ((st = fr_tp_layout_of(&m->cfg, tp_rank, tp_size, &tl))) {
        free(off);
        return st;
    }
    if (tp_size > 1 && p->gpu) {
        free(off);
        return fr_fail(FR_EUNSUPPORTED, "eval-kl: --tp %d runs on the CPU backend (--backend cpu)", tp_size);
    }
    const size_t kvt = (size_t)m->cfg.num_layers * tl.n_kv_heads;
    float *km = malloc(sizeof(float) * kvt * (size_t)m->cfg.head_dim), *f8 = malloc(sizeof(float) * kvt * 2);
    if (!km || !f8) {
        free(km); free(f8); free(off);
        return fr_fail(FR_ENOMEM, "eval-kl: out of memory");
    }
    out->n_texts = N;
    out->positions = P;
    out->latent = fr_model_is_mla(&m->cfg);
    out->n_configs = p->n_configs;
    out->results = calloc((size_t)p->n_configs, sizeof *out->results);
    ref_sink ref = {.ref = malloc(sizeof(float) * (size_t)P * V), .off = off, .vocab = V};
    if (!out->results || !ref.ref)
        st = fr_fail(FR_ENOMEM, "eval-kl: out of memory for the reference logits (%ld positions x %d)", P, V);
    for (int c = 0; c < p->n_configs && !st; c++) {
        fr_eval_result *res = &out->results[c];
        res->cfg = p->configs[c];
        res->positions = P;
        res->text_kl = calloc((size_t)N, sizeof(double));
        res->text_mismatch = calloc((size_t)N, sizeof(double));
        res->pos_kl = calloc((size_t)P, sizeof(double));
        if (!res->text_kl || !res->text_mismatch || !res->pos_kl) st = fr_fail(FR_ENOMEM, "eval-kl: out of memory");
    }

    /* The reference: BF16 KV through the same decode path. */
    if (!st) {
        fr_eval_config bf16 = {.kv = FR_KV_BF16, .compute = FR_COMPUTE_EXACT, .recipe = fr_recipe_full()};
        double t0 = fr_now_s();
        st = run_pass(&e, cache_config(&m->cfg, &bf16, NULL, &tl, km, f8), "reference (bf16)", keep_reference, &ref);
        out->seconds_reference = fr_now_s() - t0;
    }
    for (int c = 0; c < p->n_configs && !st; c++) {
        fr_eval_result *res = &out->results[c];
        kl_sink ks = {.ref = &ref, .res = res};
        char label[96];
        snprintf(label, sizeof label, "%s (%d/%d)", res->cfg.name, c + 1, p->n_configs);
        double t0 = fr_now_s();
        st = run_pass(&e, cache_config(&m->cfg, &res->cfg, p->calib, &tl, km, f8), label, measure, &ks);
        res->seconds = fr_now_s() - t0;
        if (st) break;
        for (int i = 0; i < N; i++) {
            res->text_kl[i] /= p->lens[i];
            res->text_mismatch[i] /= p->lens[i];
            res->kl += res->text_kl[i] / N;
            res->top1_mismatch += res->text_mismatch[i] / N;
        }
        if (p->verbose)
            fprintf(stderr, "eval-kl: %s: KL %.4g e-3 nats, top-1 mismatch %.2f%% (%.1f s)\n", res->cfg.name,
                    1e3 * res->kl, 100.0 * res->top1_mismatch, res->seconds);
    }
    if (!st) assign_baselines(out);
    free(ref.ref);
    free(off);
    free(km);
    free(f8);
    if (st) fr_eval_kl_report_free(out);
    return st;
}

void fr_eval_kl_report_free(fr_eval_kl_report *r)
{
    if (!r) return;
    for (int c = 0; r->results && c < r->n_configs; c++) {
        free(r->results[c].text_kl);
        free(r->results[c].text_mismatch);
        free(r->results[c].pos_kl);
    }
    free(r->results);
    memset(r, 0, sizeof *r);
}
