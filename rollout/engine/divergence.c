#include "rollout/engine/divergence.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kv_cache.h"
#include "rollout/engine/divergence_device.h"

/* ---- summaries ---- */

void fr_div_summary_add(fr_div_summary *s, const fr_kl_result *r)
{
    s->n++;
    s->kl_sum += r->kl;
    if (s->n == 1 || r->kl > s->kl_max) s->kl_max = r->kl;
    s->top1_agree += r->top1_match != 0;
    s->logp_diff_sum += r->logp_diff;
}

double fr_div_summary_mean(const fr_div_summary *s) { return s->n ? s->kl_sum / (double)s->n : NAN; }

int fr_div_bucket_of(long position)
{
    static const long ends[FR_DIV_BUCKETS - 1] = {1024, 4096, 16384, 65536};
    int b = 0;
    while (b < FR_DIV_BUCKETS - 1 && position >= ends[b]) b++;
    return b;
}

const char *fr_div_bucket_name(int b)
{
    static const char *const names[FR_DIV_BUCKETS] = {"0-1K", "1K-4K", "4K-16K", "16K-64K", "64K+"};
    return b >= 0 && b < FR_DIV_BUCKETS ? names[b] : "?";
}

const fr_div_version *fr_div_aggregates_find(const fr_div_aggregates *a, uint64_t version)
{
    for (int i = 0; i < FR_DIV_VERSIONS; i++)
        if (a->v[i].used && a->v[i].version == version) return &a->v[i];
    return NULL;
}

/* The entry of `version`, made when missing: a free one, else the oldest
 * version's. */
static fr_div_version *entry_of(fr_div_aggregates *a, uint64_t version)
{
    fr_div_version *e = (fr_div_version *)fr_div_aggregates_find(a, version);
    if (e) return e;
    for (int i = 0; i < FR_DIV_VERSIONS && !e; i++)
        if (!a->v[i].used) e = &a->v[i];
    if (!e) {
        e = &a->v[0];
        for (int i = 1; i < FR_DIV_VERSIONS; i++)
            if (a->v[i].version < e->version) e = &a->v[i];
    }
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->version = version;
    fr_hist_init(&e->kl, FR_HIST_KL);
    fr_hist_init(&e->sample_kl, FR_HIST_KL);
    return e;
}

void fr_div_aggregates_add(fr_div_aggregates *a, uint64_t version, long position, const fr_kl_result *r)
{
    fr_div_version *e = entry_of(a, version);
    fr_div_summary_add(&e->bucket[fr_div_bucket_of(position)], r);
    fr_div_summary_add(&e->all, r);
    fr_hist_add(&e->kl, r->kl);
    a->positions_total++;
    a->kl_sum_total += r->kl;
}

void fr_div_aggregates_add_sample(fr_div_aggregates *a, uint64_t version, uint64_t request_id, int sample,
                                  const fr_div_summary *s)
{
    if (!s || s->n <= 0) return;
    fr_div_version *e = entry_of(a, version);
    const double mean = fr_div_summary_mean(s);
    fr_hist_add(&e->sample_kl, mean);
    int at = e->n_worst;   /* insertion point, highest mean first */
    while (at > 0 && e->worst[at - 1].kl_mean < mean) at--;
    if (at >= FR_DIV_WORST) return;
    const int keep = e->n_worst < FR_DIV_WORST ? e->n_worst : FR_DIV_WORST - 1;
    memmove(&e->worst[at + 1], &e->worst[at], sizeof e->worst[0] * (size_t)(keep - at));
    e->worst[at] = (fr_div_worst){.request_id = request_id, .sample = sample, .positions = s->n, .kl_mean = mean};
    if (e->n_worst < FR_DIV_WORST) e->n_worst++;
}

/* ---- the shadow ---- */

struct fr_shadow {
    fr_session s;
    int chunk;
    fr_step_seq *steps;
    fr_decode_row *rows;   /* greedy: the shadow's own draws are never used */
    int *keep;             /* 0, 1, ...: every row's logits are wanted */
    int cap;
    int launched;          /* sequences of a launched step not yet waited for */
    fr_shadow_dev *dev;    /* measuring where the logits are: a shadow on a device; NULL on the host */
};

fr_status fr_shadow_open(fr_session *main, int max_seqs, int n_blocks, fr_shadow **out)
{
    if (!main || !out) return fr_fail(FR_EINVAL, "fr_shadow_open: NULL argument");
    *out = NULL;
    if (max_seqs < 1 || n_blocks < 2)
        return fr_fail(FR_EINVAL, "shadow: %d sequences and %d KV blocks", max_seqs, n_blocks);
    fr_shadow *sh = calloc(1, sizeof *sh);
    if (!sh) return fr_fail(FR_ENOMEM, "shadow: out of memory");
    sh->chunk = 256;
    sh->cap = max_seqs;
    sh->steps = malloc(sizeof *sh->steps * (size_t)max_seqs);
    sh->rows = calloc((size_t)max_seqs, sizeof *sh->rows);
    sh->keep = malloc(sizeof *sh->keep * (size_t)max_seqs);
    for (int i = 0; sh->rows && sh->keep && i < max_seqs; i++) {
        sh->rows[i].params = (fr_sampling_params){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f};
        sh->keep[i] = i;
    }
    const int step_tokens = sh->chunk > max_seqs ? sh->chunk : max_seqs;
    fr_status st = sh->steps && sh->rows && sh->keep
                       ? fr_session_open_shadow(main, n_blocks, max_seqs, step_tokens, &sh->s)
                       : fr_fail(FR_ENOMEM, "shadow: out of memory");
    if (!st && (st = fr_shadow_dev_new(&sh->s, max_seqs, &sh->dev))) fr_session_close(&sh->s);
    if (st) {
        free(sh->rows);
        free(sh->keep);
        free(sh->steps);
        free(sh);
        return st;
    }
    *out = sh;
    return FR_OK;
}

void fr_shadow_close(fr_shadow **psh)
{
    fr_shadow *sh = psh ? *psh : NULL;
    if (!sh) return;
    fr_shadow_dev_destroy(&sh->dev);
    fr_session_close(&sh->s);
    free(sh->rows);
    free(sh->keep);
    free(sh->steps);
    free(sh);
    *psh = NULL;
}

fr_status fr_shadow_start(fr_shadow *sh, const int *tokens, int n, int *shadow_seq, float *ref_logits)
{
    if (!sh || !tokens || n < 1 || !shadow_seq || !ref_logits)
        return fr_fail(FR_EINVAL, "fr_shadow_start: bad argument");
    const int need = (n + FR_PAGE_TOKENS - 1) / FR_PAGE_TOKENS;
    if (fr_kv_free_blocks(sh->s.kv) < need + 1)
        return fr_fail(FR_ENOMEM, "shadow: %d free KV blocks, a prompt of %d tokens needs %d",
                       fr_kv_free_blocks(sh->s.kv), n, need + 1);
    return fr_session_prefill(&sh->s, tokens, n, sh->chunk, shadow_seq, ref_logits, NULL);
}

fr_status fr_shadow_step(fr_shadow *sh, const int *shadow_seqs, const int *tokens, int n, float *ref_logits)
{
    if (!sh || n < 0 || n > sh->cap || (n && (!shadow_seqs || !tokens || !ref_logits)))
        return fr_fail(FR_EINVAL, "fr_shadow_step: bad argument");
    if (n == 0) return FR_OK;
    for (int i = 0; i < n; i++)
        sh->steps[i] = (fr_step_seq){.seq = shadow_seqs[i], .n = 1, .tokens = &tokens[i], .all_logits = 0};
    /* The decode path: on CUDA a replayed graph, and only these rows' logits
     * come back to the host. */
    return fr_session_decode_keep(&sh->s, sh->steps, sh->rows, n, NULL, NULL, sh->keep, n, ref_logits);
}

int fr_shadow_on_device(const fr_shadow *sh) { return sh && sh->dev; }

/* Whether served's decodes can be measured against the shadow's on the device. */
static int measurable(const fr_shadow *sh, const fr_session *served)
{
    return fr_shadow_on_device(sh) && served && fr_runner_on_device(served->runner);
}

fr_status fr_shadow_launch(fr_shadow *sh, const int *shadow_seqs, const int *tokens, int n)
{
    if (!fr_shadow_on_device(sh)) return fr_fail(FR_EUNSUPPORTED, "shadow: a launched step needs the CUDA backend");
    if (n < 1 || n > sh->cap || !shadow_seqs || !tokens) return fr_fail(FR_EINVAL, "fr_shadow_launch: bad argument");
    for (int i = 0; i < n; i++)
        sh->steps[i] = (fr_step_seq){.seq = shadow_seqs[i], .n = 1, .tokens = &tokens[i], .all_logits = 0};
    sh->launched = n;
    fr_status st = fr_session_decode_launch(&sh->s, sh->steps, sh->rows, n);
    if (st) sh->launched = 0;
    return st;
}

fr_status fr_shadow_wait_kl(fr_shadow *sh, fr_session *served, const int *served_rows, const int *chosen, int n,
                            fr_kl_result *out)
{
    if (!measurable(sh, served)) return fr_fail(FR_EUNSUPPORTED, "shadow: measuring on the device needs the CUDA backend");
    if (n < 1 || n != sh->launched || !served_rows || !chosen || !out) {
        if (sh->launched) fr_session_decode_wait(&sh->s, sh->steps, sh->launched, NULL, NULL, NULL, 0, NULL);
        sh->launched = 0;
        return fr_fail(FR_EINVAL, "fr_shadow_wait_kl: bad argument");
    }
    sh->launched = 0;
    fr_status st = fr_session_decode_wait(&sh->s, sh->steps, n, NULL, NULL, NULL, 0, NULL);
    return st ? st : fr_shadow_dev_decodes(sh->dev, &sh->s, served, sh->keep, served_rows, chosen, n, out);
}

fr_status fr_shadow_launch_carried(fr_shadow *sh, fr_session *served, const fr_step_seq *seqs, const fr_decode_row *rows,
                                   int n_seqs, const int *shadow_seqs, const int *tokens, int n,
                                   const int *served_rows)
{
    if (!fr_shadow_on_device(sh)) return fr_fail(FR_EUNSUPPORTED, "shadow: a carried step needs the CUDA backend");
    if (n < 1 || n > sh->cap || !shadow_seqs || !tokens)
        return fr_fail(FR_EINVAL, "fr_shadow_launch_carried: bad argument");
    for (int i = 0; i < n; i++)
        sh->steps[i] = (fr_step_seq){.seq = shadow_seqs[i], .n = 1, .tokens = &tokens[i], .all_logits = 0};
    fr_status st = fr_session_decode_launch_carrying(served, seqs, rows, n_seqs, &sh->s, sh->steps, n);
    fr_shadow_dev_carried_launched(sh->dev, served, st ? NULL : served_rows, n);
    return st;
}

fr_status fr_shadow_carried_kl(fr_shadow *sh, fr_session *served, const int *served_rows, const int *chosen, int n,
                               fr_kl_result *out)
{
    if (!measurable(sh, served)) return fr_fail(FR_EUNSUPPORTED, "shadow: measuring on the device needs the CUDA backend");
    if (n < 1 || n > sh->cap || !served_rows || !chosen || !out)
        return fr_fail(FR_EINVAL, "fr_shadow_carried_kl: bad argument");
    return fr_shadow_dev_carried(sh->dev, served, served_rows, chosen, n, out);
}

fr_status fr_shadow_measure_rows(fr_shadow *sh, const float *const *ref, const float *const *served, const int *chosen,
                                 int n, fr_kl_result *out)
{
    if (!sh || !ref || !served || !chosen || !out || n < 1 || n > sh->cap)
        return fr_fail(FR_EINVAL, "fr_shadow_measure_rows: bad argument");
    const int V = sh->s.model->cfg.vocab_size;
    for (int j = 0; j < n; j++) {
        if (!ref[j] || !served[j]) return fr_fail(FR_EINVAL, "fr_shadow_measure_rows: row %d is NULL", j);
        if (chosen[j] < -1 || chosen[j] >= V) return fr_fail(FR_EINVAL, "fr_shadow_measure_rows: token %d", chosen[j]);
    }
    if (fr_shadow_on_device(sh)) return fr_shadow_dev_rows(sh->dev, &sh->s, ref, served, chosen, n, out);
    for (int j = 0; j < n; j++) {
        fr_status st = fr_kl_topk(ref[j], served[j], V, FR_KL_TOP_K, chosen[j], &out[j]);
        if (st) return st;
    }
    return FR_OK;
}

fr_status fr_shadow_step_kl(fr_shadow *sh, fr_session *served, const int *shadow_seqs, const int *tokens, int n,
                            const int *served_rows, const int *chosen, fr_kl_result *out)
{
    if (n == 0) return FR_OK;
    fr_status st = fr_shadow_launch(sh, shadow_seqs, tokens, n);
    return st ? st : fr_shadow_wait_kl(sh, served, served_rows, chosen, n, out);
}

fr_status fr_shadow_fork(fr_shadow *sh, int src, int *dst)
{
    if (!sh || !dst) return fr_fail(FR_EINVAL, "fr_shadow_fork: NULL argument");
    return fr_session_fork(&sh->s, src, dst);
}

int fr_shadow_blocks_needed(const fr_shadow *sh, int seq) { return fr_kv_blocks_needed(sh->s.kv, seq, 1); }

void fr_shadow_drop(fr_shadow *sh, int shadow_seq)
{
    if (sh && shadow_seq >= 0) fr_kv_seq_free(sh->s.kv, shadow_seq);
}

void fr_shadow_capture_stats(const fr_shadow *sh, int *captures, double *seconds)
{
    fr_session_capture_stats(sh ? &sh->s : NULL, captures, seconds);
}

int fr_shadow_free_blocks(const fr_shadow *sh) { return sh ? fr_kv_free_blocks(sh->s.kv) : 0; }
