#include "rollout/monitor/calibrate.h"

#include "base/clock.h"
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attention/fp_formats.h"
#include "base/buf.h"
#include "attention/prob_quant.h"
#include "rollout/model/runner.h"

enum { P_BLOCK = 16 };   /* NVFP4 probability block: the only format tau applies to */

/* ---- byte texts ---- */

fr_status fr_byte_text_read(const fr_model_config *cfg, const char *path, int max_tokens, int **ids, int *n)
{
    *ids = NULL;
    *n = 0;
    if (cfg->bos_id < 0 || cfg->bos_id >= cfg->vocab_size)
        return fr_fail(FR_EINVAL, "%s: the model has no BOS token id to start a text with", path);
    if (cfg->vocab_size < 256)
        return fr_fail(FR_EINVAL, "%s: texts are read as bytes, but the model's vocabulary has only %d ids",
                       path, cfg->vocab_size);
    if (max_tokens <= 0 || max_tokens > cfg->max_position) max_tokens = cfg->max_position;
    FILE *f = fopen(path, "rb");
    if (!f) return fr_fail(FR_EIO, "cannot read text file %s", path);
    int *out = malloc(sizeof(int) * (size_t)max_tokens);
    unsigned char *buf = malloc((size_t)max_tokens);
    fr_status st = out && buf ? FR_OK : fr_fail(FR_ENOMEM, "%s: out of memory", path);
    size_t got = 0;
    if (!st) {
        got = fread(buf, 1, (size_t)max_tokens - 1, f);
        if (ferror(f)) st = fr_fail(FR_EIO, "cannot read text file %s", path);
    }
    fclose(f);
    if (!st) {
        out[0] = cfg->bos_id;
        for (size_t i = 0; i < got; i++) out[i + 1] = buf[i];
        *ids = out;
        *n = (int)got + 1;
    } else {
        free(out);
    }
    free(buf);
    return st;
}

/* The bytes of path into b. */
static fr_status read_all(const char *path, fr_buf *b)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fr_fail(FR_EIO, "cannot read text file %s", path);
    char chunk[1 << 16];
    size_t got;
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) fr_buf_put(b, chunk, got);
    const int bad = ferror(f);
    fclose(f);
    if (bad) return fr_fail(FR_EIO, "cannot read text file %s", path);
    return b->failed ? fr_fail(FR_ENOMEM, "%s: out of memory", path) : FR_OK;
}

fr_status fr_text_file_read(const fr_model_config *cfg, const fr_tokenizer *tok, const char *path, int max_tokens,
                            int **ids, int *n)
{
    if (!tok) return fr_byte_text_read(cfg, path, max_tokens, ids, n);
    *ids = NULL;
    *n = 0;
    if (max_tokens <= 0 || max_tokens > cfg->max_position) max_tokens = cfg->max_position;
    fr_buf b = {0};
    int *enc = NULL;
    size_t got = 0;
    fr_status st = read_all(path, &b);
    if (!st && (st = fr_tokenizer_encode(tok, b.data ? b.data : "", b.len, 1, &enc, &got))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        st = fr_fail(st, "%s: %s", path, msg);
    }
    fr_buf_free(&b);
    if (!st && got == 0) st = fr_fail(FR_EINVAL, "%s: the text encodes to no token", path);
    const int lead = !st && cfg->bos_id >= 0 && enc[0] != cfg->bos_id;   /* the tokenizer adds no BOS */
    int *out = st ? NULL : malloc(sizeof(int) * (size_t)max_tokens);
    if (!st && !out) st = fr_fail(FR_ENOMEM, "%s: out of memory", path);
    if (!st) {
        int k = 0;
        if (lead) out[k++] = cfg->bos_id;
        for (size_t i = 0; i < got && k < max_tokens; i++) out[k++] = enc[i];
        *ids = out;
        *n = k;
    }
    free(enc);
    return st;
}

/* ---- tau ---- */

float fr_tau_candidate(int code)
{
    if (code < 0) code = 0;
    if (code >= FR_TAU_CODES) code = FR_TAU_CODES - 1;
    return 0.5f * (fr_e4m3_decode((uint8_t)code) + fr_e4m3_decode((uint8_t)(code + 1)));
}

void fr_tau_stats_init(fr_tau_stats *s) { memset(s, 0, sizeof *s); }

/* The smallest candidate k with x <= tau_k, FR_TAU_CODES when none. */
static int tau_bin(float x)
{
    int lo = 0, hi = FR_TAU_CODES;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (x <= fr_tau_candidate(mid)) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

static double block_sse(const float *cp, float p_max, float tau)
{
    fr_pquant_params pp = {.underflow_aware = 1, .c = FR_P_SCALE_C, .tau = tau};
    float deq[P_BLOCK];
    fr_pquant_block(FR_NVFP4, &pp, cp, p_max, deq);
    double e = 0.0;
    for (int i = 0; i < P_BLOCK; i++) e += ((double)deq[i] - cp[i]) * ((double)deq[i] - cp[i]);
    return e;
}

void fr_tau_stats_add_block(fr_tau_stats *s, const float *cp, float p_max)
{
    if (!(p_max > 0.0f)) return;
    /* tau = +inf forces kappa 2, tau = -1 forces kappa 6 */
    double e2 = block_sse(cp, p_max, INFINITY), e6 = block_sse(cp, p_max, -1.0f);
    int bin = tau_bin(FR_P_SCALE_C * p_max);
    s->err6 += e6;
    s->diff[bin] += e2 - e6;
    s->count[bin]++;
    s->blocks++;
}

double fr_tau_stats_error(const fr_tau_stats *s, int code)
{
    double e = s->err6;
    for (int k = 0; k <= code && k < FR_TAU_CODES; k++) e += s->diff[k];
    return e;
}

int fr_tau_stats_select(const fr_tau_stats *s)
{
    if (s->blocks == 0) return FR_TAU_DEFAULT_CODE;
    int best = -1;
    double best_err = 0.0, e = s->err6;
    for (int k = 0; k < FR_TAU_CODES; k++) {
        e += s->diff[k];
        int dk = abs(k - FR_TAU_DEFAULT_CODE), db = abs(best - FR_TAU_DEFAULT_CODE);
        if (best < 0 || e < best_err || (e == best_err && dk < db)) {
            best = k;
            best_err = e;
        }
    }
    return best;
}

fr_status fr_tau_replay_query(fr_tau_stats *s, const float *q, const float *k, int n, int d, int n_sink,
                              int tile, float *scratch)
{
    if (!s || !q || !k || !scratch || n < 0 || d < 1 || tile < P_BLOCK || tile % P_BLOCK)
        return fr_fail(FR_EINVAL, "tau replay: invalid arguments");
    if (n == 0) return FR_OK;
    const float gamma = (float)(M_LOG2E / sqrt((double)d)), log2c = log2f(FR_P_SCALE_C);
    float *S = scratch;
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, d, gamma, k, d, q, 1, 0.0f, S, 1);
    for (int t = 0; t < n_sink && t < n; t++) S[t] = -INFINITY;
    float m = -INFINITY;
    for (int a = 0; a < n; a += tile) {
        int b = a + tile < n ? a + tile : n;
        float tile_max = -INFINITY;
        for (int t = a; t < b; t++) tile_max = fmaxf(tile_max, S[t]);
        if (tile_max == -INFINITY) continue;
        float m_new = fmaxf(m, tile_max);
        for (int i0 = a; i0 < b; i0 += P_BLOCK) {
            float cp[P_BLOCK], smax = -INFINITY;
            for (int j = 0; j < P_BLOCK; j++) {
                int t = i0 + j;
                float st = t < b ? S[t] : -INFINITY;
                cp[j] = st == -INFINITY ? 0.0f : exp2f(st - m_new + log2c);
                smax = fmaxf(smax, st);
            }
            if (smax == -INFINITY) continue;
            fr_tau_stats_add_block(s, cp, exp2f(smax - m_new));
        }
        m = m_new;
    }
    return FR_OK;
}

/* ---- the whole calibration ---- */

void fr_calib_opts_default(fr_calib_opts *o)
{
    *o = (fr_calib_opts){.context = -1, .seed_tokens = 256, .continue_tokens = 64, .tau_steps = 32,
                         .chunk = 512, .kv = FR_KV_BF16, .verbose = 0};
}

void fr_calib_report_free(fr_calib_report *r)
{
    if (!r) return;
    free(r->tokens);
    r->tokens = NULL;
}

typedef struct {
    const fr_model_config *cfg;
    int latent_dim;       /* latent attention: the latent part of each cached row */
    double *ksum;         /* [layers][kv_heads][d] */
    float *amax;          /* [layers][kv_heads][2] */
    long rows;            /* tokens accumulated */
    int pos;              /* the observed sequence's length before the step */
    int store_bf16;       /* keys are replayed in BF16 store form (bf16 cache) */
    float *keys;          /* [layers][kv_heads][context][d]: the sequence's keys as
                             cached, for the tau replay (NULL without tau steps) */
    int context;
    int tau_on;
    fr_tau_stats tau;
    float *scratch;       /* logits of one query over the context */
} calib_state;

static fr_status on_layer_kv(void *user, int layer, const fr_step_seq *seqs, int n_seqs, const float *k,
                             const float *v)
{
    calib_state *cs = user;
    const int H = cs->cfg->num_kv_heads, d = cs->cfg->head_dim;
    int rows = 0;
    for (int s = 0; s < n_seqs; s++) rows += seqs[s].n;
    for (int t = 0; t < rows; t++)
        for (int h = 0; h < H; h++) {
            const float *kt = k + ((size_t)t * H + h) * d, *vt = v + ((size_t)t * H + h) * d;
            double *sum = cs->ksum + ((size_t)layer * H + h) * d;
            float *am = cs->amax + ((size_t)layer * H + h) * 2;
            /* a latent row's FP8 scale covers its latent only (the RoPE part stays BF16) */
            const int scaled = cs->latent_dim > 0 ? cs->latent_dim : d;
            for (int c = 0; c < d; c++) sum[c] += kt[c];
            for (int c = 0; c < scaled; c++) {
                am[0] = fmaxf(am[0], fabsf(kt[c]));
                am[1] = fmaxf(am[1], fabsf(vt[c]));
            }
            if (cs->keys && cs->pos + t < cs->context) {
                float *dst = cs->keys + (((size_t)layer * H + h) * cs->context + (size_t)(cs->pos + t)) * d;
                for (int c = 0; c < d; c++) dst[c] = cs->store_bf16 ? fr_bf16_round(kt[c]) : kt[c];
            }
        }
    if (layer == 0) cs->rows += rows;
    return FR_OK;
}

/* A decode step's queries (one token: the step's only row). An FP4 cache
 * would hold the full pages of the stored tokens in FP4, the sink masked:
 * the queries replay online softmax over those keys as cached. */
static fr_status on_layer_q(void *user, int layer, const fr_step_seq *seqs, int n_seqs, const float *q)
{
    calib_state *cs = user;
    const int H = cs->cfg->num_kv_heads, G = cs->cfg->num_heads / H, d = cs->cfg->head_dim;
    const int full = cs->pos / FR_PAGE_TOKENS * FR_PAGE_TOKENS;
    fr_status st = FR_OK;
    if (layer == cs->cfg->num_layers - 1)   /* the last tap of the step: the sequence grows after it */
        for (int s = 0; s < n_seqs; s++) cs->pos += seqs[s].n;
    if (!cs->tau_on) return FR_OK;
    if (n_seqs != 1 || seqs[0].n != 1) return fr_fail(FR_EINTERNAL, "calibrate: a tau step has one token");
    for (int h = 0; h < H && !st && full > FR_SINK_TOKENS; h++)
        for (int g = 0; g < G && !st; g++)
            st = fr_tau_replay_query(&cs->tau, q + ((size_t)h * G + g) * d,
                                     cs->keys + ((size_t)layer * H + h) * cs->context * d, full, d, FR_SINK_TOKENS,
                                     FR_PAGE_TOKENS, cs->scratch);
    return st;
}

/* One step of the passes (on the runner the options ask for: the CUDA one
 * with device weights), every logit row to logits. */
static fr_status run_step(fr_runner *r, const fr_step_seq *seqs, int n_seqs, float *logits)
{
    const fr_batch b = {.kind = FR_BATCH_STEP, .seqs = seqs, .n_seqs = n_seqs, .logits = logits};
    return fr_runner_run(r, &b);
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int is_eos(const fr_model_config *cfg, int tok)
{
    for (int i = 0; i < cfg->n_eos; i++)
        if (cfg->eos_ids[i] == tok) return 1;
    return 0;
}

/* Prefills tokens[0, n) into seq in chunks; the last position's logits to last. */
static fr_status prefill(fr_runner *r, int seq, const int *tokens, int n, int chunk, float *last,
                         const char *what, int verbose)
{
    fr_status st = FR_OK;
    double t0 = fr_now_s(), shown = t0;
    for (int i = 0; i < n && !st; i += chunk) {
        int m = n - i < chunk ? n - i : chunk;
        fr_step_seq step = {.seq = seq, .n = m, .tokens = tokens + i, .all_logits = 0};
        st = run_step(r, &step, 1, last);
        if (verbose && (fr_now_s() - shown > 2.0 || i + m == n)) {
            fprintf(stderr, "calibrate: %s %d/%d tokens (%.1f s)\n", what, i + m, n, fr_now_s() - t0);
            shown = fr_now_s();
        }
    }
    return st;
}

static fr_status check_opts(const fr_model_config *cfg, const fr_calib_opts *o, int n_texts,
                            const int *const *texts, const int *lens, int context)
{
    if (o->kv != FR_KV_BF16 && o->kv != FR_KV_F32)
        return fr_fail(FR_EINVAL, "calibrate: the passes run with a bf16 or f32 cache, not %s",
                       fr_kv_dtype_name(o->kv));
    if (n_texts < 1 || !texts || !lens) return fr_fail(FR_EINVAL, "calibrate: no seed text");
    if (context < 2 || context > cfg->max_position)
        return fr_fail(FR_EINVAL, "calibrate: context %d outside [2, %d] (the model's window)", context,
                       cfg->max_position);
    if (o->tau_steps < 0 || o->tau_steps >= context)
        return fr_fail(FR_EINVAL, "calibrate: %d tau steps leave no room to prefill a context of %d",
                       o->tau_steps, context);
    if (o->seed_tokens < 1 || o->continue_tokens < 0 || o->chunk < 1)
        return fr_fail(FR_EINVAL, "calibrate: seed tokens (%d) and chunk (%d) must be >= 1, continuation "
                                  "(%d) >= 0", o->seed_tokens, o->chunk, o->continue_tokens);
    if (o->continue_tokens + 2 > cfg->max_position)
        return fr_fail(FR_EINVAL, "calibrate: a continuation of %d tokens does not fit the window of %d",
                       o->continue_tokens, cfg->max_position);
    if (cfg->bos_id < 0 || cfg->bos_id >= cfg->vocab_size)
        return fr_fail(FR_EINVAL, "calibrate: the model has no BOS token id");
    for (int i = 0; i < n_texts; i++) {
        if (!texts[i] || lens[i] < 1) return fr_fail(FR_EINVAL, "calibrate: seed text %d is empty", i);
        for (int j = 0; j < lens[i]; j++)
            if (texts[i][j] < 0 || texts[i][j] >= cfg->vocab_size)
                return fr_fail(FR_EINVAL, "calibrate: seed text %d has id %d outside the vocabulary", i,
                               texts[i][j]);
    }
    return FR_OK;
}

/* Step 1: continues every seed greedily, all texts in one batch. cont[i]
 * receives text i's continuation (EOS ends it, not kept), n_cont[i] its length. */
static fr_status continue_seeds(fr_runner *r, fr_kv_cache *kv, const fr_model_config *cfg,
                                const fr_calib_opts *o, int n_texts, const int *const *texts,
                                const int *plen, int **cont, int *n_cont)
{
    const int V = cfg->vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)V * n_texts);
    int *seq = malloc(sizeof(int) * (size_t)n_texts), *tok = malloc(sizeof(int) * (size_t)n_texts);
    int *live = malloc(sizeof(int) * (size_t)n_texts);
    fr_step_seq *steps = malloc(sizeof *steps * (size_t)n_texts);
    fr_status st = logits && seq && tok && live && steps ? FR_OK : fr_fail(FR_ENOMEM, "calibrate: out of memory");
    int opened = 0;
    for (int i = 0; i < n_texts && !st; i++) {
        if ((st = fr_kv_seq_new(kv, &seq[i]))) break;
        opened++;
        st = prefill(r, seq[i], texts[i], plen[i], o->chunk, logits + (size_t)i * V, "seed prefill",
                     o->verbose && n_texts == 1);
        live[i] = 1;
        n_cont[i] = 0;
    }
    if (!st && o->verbose)
        fprintf(stderr, "calibrate: %d seed texts prefilled, continuing each for %d greedy tokens\n", n_texts,
                o->continue_tokens);
    for (int step = 0; step < o->continue_tokens && !st; step++) {
        int ns = 0;
        /* logits row i belongs to the i-th live text of the previous step */
        for (int i = 0, row = 0; i < n_texts; i++) {
            if (!live[i]) continue;
            int t = argmax(logits + (size_t)row++ * V, V);
            if (is_eos(cfg, t)) { live[i] = 0; continue; }
            cont[i][n_cont[i]++] = t;
            tok[i] = t;
        }
        if (step + 1 == o->continue_tokens) break;
        for (int i = 0; i < n_texts; i++)
            if (live[i]) steps[ns++] = (fr_step_seq){.seq = seq[i], .n = 1, .tokens = &tok[i], .all_logits = 0};
        if (ns == 0) break;
        st = run_step(r, steps, ns, logits);
    }
    for (int i = 0; i < opened; i++) fr_kv_seq_free(kv, seq[i]);
    free(logits); free(seq); free(tok); free(live); free(steps);
    return st;
}

/* Each seed's prompt length (BOS and up to seed_tokens bytes, leaving room
 * for the continuation), room for its continuation, and the blocks the
 * seeds take together. */
static fr_status plan_seeds(const fr_model_config *cfg, const fr_calib_opts *o, int n_texts, const int *lens,
                            int *plen, int **cont, int *seed_blocks)
{
    *seed_blocks = 0;
    for (int i = 0; i < n_texts; i++) {
        int cap = cfg->max_position - o->continue_tokens;
        plen[i] = lens[i];
        if (plen[i] > 1 + o->seed_tokens) plen[i] = 1 + o->seed_tokens;
        if (plen[i] > cap) plen[i] = cap;
        *seed_blocks += (plen[i] + o->continue_tokens + FR_PAGE_TOKENS - 1) / FR_PAGE_TOKENS;
        cont[i] = malloc(sizeof(int) * (size_t)(o->continue_tokens + 1));
        if (!cont[i]) return fr_fail(FR_ENOMEM, "calibrate: out of memory");
    }
    return FR_OK;
}

/* Step 2: the seeds after BOS and their continuations joined, tiled over
 * tokens[1, context) after BOS. *body_len receives the joined length. */
static fr_status tile_text(const fr_model_config *cfg, int n_texts, const int *const *texts, const int *plen,
                           int *const *cont, const int *n_cont, int context, int *tokens, int *body_len)
{
    int len = 0;
    for (int i = 0; i < n_texts; i++) len += plen[i] - 1 + n_cont[i];
    *body_len = len;
    if (len == 0) return fr_fail(FR_EINVAL, "calibrate: the seed texts hold no token after BOS");
    int *body = malloc(sizeof(int) * (size_t)len);
    if (!body) return fr_fail(FR_ENOMEM, "calibrate: out of memory");
    int at = 0;
    for (int i = 0; i < n_texts; i++) {
        memcpy(body + at, texts[i] + 1, sizeof(int) * (size_t)(plen[i] - 1));
        at += plen[i] - 1;
        memcpy(body + at, cont[i], sizeof(int) * (size_t)n_cont[i]);
        at += n_cont[i];
    }
    tokens[0] = cfg->bos_id;
    for (int j = 1; j < context; j++) tokens[j] = body[(j - 1) % len];
    free(body);
    return FR_OK;
}

/* Step 4: decode steps continuing the prefill greedily from logits; their
 * queries calibrate tau. */
static fr_status tau_steps(fr_runner *r, calib_state *cs, const fr_calib_opts *o, int seq, int n_prefill,
                           int *tokens, float *logits, double t2)
{
    const int V = cs->cfg->vocab_size, context = cs->context;
    fr_status st = FR_OK;
    cs->tau_on = !cs->latent_dim;   /* no tau replay over latent rows */
    for (int i = n_prefill; i < context && !st; i++) {
        tokens[i] = argmax(logits, V);
        fr_step_seq step = {.seq = seq, .n = 1, .tokens = &tokens[i], .all_logits = 0};
        st = run_step(r, &step, 1, logits);
        if (o->verbose && !st && (i + 1 == context || (i + 1 - n_prefill) % 64 == 0))
            fprintf(stderr, "calibrate: tau decode step %d/%d (%ld probability blocks, %.1f s)\n",
                    i + 1 - n_prefill, o->tau_steps, cs->tau.blocks, fr_now_s() - t2);
    }
    return st;
}

/* The calibration from what the passes gathered: key mean (the latent's
 * RoPE part not smoothed: zeros), FP8 scales, tau. *code receives tau's
 * candidate. */
static fr_status results(const calib_state *cs, const fr_calib_opts *o, fr_calib *out, int *code)
{
    const fr_model_config *cfg = cs->cfg;
    const int L = cfg->num_layers, H = cfg->num_kv_heads, d = cfg->head_dim, dc = cs->latent_dim;
    out->key_mean = malloc(sizeof(float) * (size_t)L * H * d);
    out->fp8_scales = malloc(sizeof(float) * (size_t)L * H * 2);
    if (!out->key_mean || !out->fp8_scales) return fr_fail(FR_ENOMEM, "calibrate: out of memory");
    for (size_t i = 0; i < (size_t)L * H * d; i++) out->key_mean[i] = (float)(cs->ksum[i] / (double)cs->rows);
    for (int l = 0; dc && l < L; l++)
        memset(out->key_mean + (size_t)l * d + dc, 0, sizeof(float) * (size_t)(d - dc));
    for (size_t i = 0; i < (size_t)L * H * 2; i++)
        out->fp8_scales[i] = cs->amax[i] > 0.0f && isfinite(cs->amax[i]) ? cs->amax[i] / FR_E4M3_MAX : 1.0f;
    *code = o->tau_steps > 0 ? fr_tau_stats_select(&cs->tau) : FR_TAU_DEFAULT_CODE;
    out->tau = o->tau_steps > 0 ? fr_tau_candidate(*code) : FR_P_TAU;
    out->has_tau = 1;
    return FR_OK;
}

/* The report's figures of tau's choice. */
static void report_tau(const calib_state *cs, int code, fr_calib_report *rep)
{
    rep->tau_code = code;
    rep->tau_blocks = cs->tau.blocks;
    rep->tau_err = fr_tau_stats_error(&cs->tau, code);
    rep->tau_err_default = fr_tau_stats_error(&cs->tau, FR_TAU_DEFAULT_CODE);
    for (int k = 0; k < FR_TAU_CODES; k++) rep->tau_err_by_code[k] = fr_tau_stats_error(&cs->tau, k);
    memcpy(rep->tau_blocks_by_bin, cs->tau.count, sizeof cs->tau.count);
}

/* The accumulators of the passes over a window of `context` tokens (the
 * key buffer of the tau replay only with tau steps on a non-latent model). */
static fr_status state_new(const fr_model_config *cfg, const fr_calib_opts *o, int context, calib_state *cs)
{
    const int L = cfg->num_layers, H = cfg->num_kv_heads, d = cfg->head_dim, dc = cfg->kv_lora_rank;
    /* Latent attention calibrates the latent mean and the latent's FP8
     * scale; it quantizes no probability, so tau is not measured. */
    *cs = (calib_state){.cfg = cfg, .latent_dim = dc, .context = context, .store_bf16 = o->kv == FR_KV_BF16};
    cs->ksum = calloc((size_t)L * H * d, sizeof(double));
    cs->amax = calloc((size_t)L * H * 2, sizeof(float));
    cs->scratch = malloc(sizeof(float) * (size_t)context);
    if (o->tau_steps > 0 && !dc) cs->keys = malloc(sizeof(float) * (size_t)L * H * context * d);
    fr_tau_stats_init(&cs->tau);
    if (!cs->ksum || !cs->amax || !cs->scratch || (o->tau_steps > 0 && !dc && !cs->keys))
        return fr_fail(FR_ENOMEM, "calibrate: out of memory");
    return FR_OK;
}

/* The passes' cache and runner: bf16 or f32 pages for the seeds or the
 * window, whichever needs more; no step is longer than the chunk. */
static fr_status open_passes(const fr_model *m, const fr_calib_opts *o, int n_texts, int seed_blocks, int context,
                             fr_kv_cache **kv, fr_runner **r)
{
    const fr_model_config *cfg = &m->cfg;
    const int main_blocks = (context + FR_PAGE_TOKENS - 1) / FR_PAGE_TOKENS;
    fr_kv_cache_config kc = {.n_layers = cfg->num_layers, .n_kv_heads = cfg->num_kv_heads, .head_dim = cfg->head_dim,
                             .latent_dim = cfg->kv_lora_rank, .dtype = o->kv, .compute = FR_COMPUTE_EXACT,
                             .recipe = fr_recipe_full(), .tau = FR_P_TAU,
                             .n_blocks = (seed_blocks > main_blocks ? seed_blocks : main_blocks) + 1,
                             .max_seqs = n_texts, .bookkeeping_only = o->gpu != NULL};
    fr_status st = fr_kv_cache_new(&kc, kv);
    if (st) return st;
    const fr_runner_config rc = {.model = m, .gpu = o->gpu, .kv = *kv,
                                 .max_step_tokens = o->chunk > n_texts ? o->chunk : n_texts,
                                 .deterministic = o->deterministic};
    return fr_runner_open(&rc, r);
}

fr_status fr_calibrate(const fr_model *m, const fr_calib_opts *o, int n_texts, const int *const *texts,
                       const int *lens, fr_calib *out, fr_calib_report *rep)
{
    const fr_model_config *cfg = &m->cfg;
    int context = o->context > 0 ? o->context : cfg->max_position;
    if (o->context < 0 && context > FR_CALIB_DEFAULT_CONTEXT) context = FR_CALIB_DEFAULT_CONTEXT;
    memset(out, 0, sizeof *out);
    if (rep) memset(rep, 0, sizeof *rep);
    fr_status st = check_opts(cfg, o, n_texts, texts, lens, context);
    if (st) return st;

    int *plen = calloc((size_t)n_texts, sizeof(int)), *n_cont = calloc((size_t)n_texts, sizeof(int));
    int **cont = calloc((size_t)n_texts, sizeof(int *));
    int *tokens = malloc(sizeof(int) * (size_t)context);
    float *logits = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    calib_state cs;
    fr_kv_cache *kv = NULL;
    fr_runner *r = NULL;
    st = state_new(cfg, o, context, &cs);
    if (!st && (!plen || !n_cont || !cont || !tokens || !logits)) st = fr_fail(FR_ENOMEM, "calibrate: out of memory");
    int seed_blocks = 0, body_len = 0;
    if (!st) st = plan_seeds(cfg, o, n_texts, lens, plen, cont, &seed_blocks);
    /* no step is longer than the window: size the runner for what a chunk can be */
    fr_calib_opts oc = *o;
    if (oc.chunk > context) oc.chunk = context;
    o = &oc;
    if (!st) st = open_passes(m, o, n_texts, seed_blocks, context, &kv, &r);

    /* 1. continue the seeds */
    double t0 = fr_now_s();
    if (!st && o->continue_tokens > 0) st = continue_seeds(r, kv, cfg, o, n_texts, texts, plen, cont, n_cont);
    double t1 = fr_now_s();

    /* 2. join and tile */
    if (!st) st = tile_text(cfg, n_texts, texts, plen, cont, n_cont, context, tokens, &body_len);

    /* 3. one prefill, keys observed */
    const int n_prefill = context - o->tau_steps;
    int seq = -1;
    fr_forward_observer obs = {.user = &cs, .layer_kv = on_layer_kv, .layer_q = on_layer_q};
    if (!st) st = fr_runner_set_observer(r, &obs);
    if (!st) {
        if (o->verbose)
            fprintf(stderr, "calibrate: joined text of %d tokens tiled to %d; prefilling %d tokens\n", body_len,
                    context, n_prefill);
        st = fr_kv_seq_new(kv, &seq);
        if (!st) st = prefill(r, seq, tokens, n_prefill, o->chunk, logits, "prefill", o->verbose);
    }
    double t2 = fr_now_s();

    /* 4. decode steps continuing it: their queries calibrate tau */
    if (!st) st = tau_steps(r, &cs, o, seq, n_prefill, tokens, logits, t2);
    double t3 = fr_now_s();

    int code = FR_TAU_DEFAULT_CODE;
    if (!st) st = results(&cs, o, out, &code);
    if (!st && rep) {
        report_tau(&cs, code, rep);
        rep->tokens = tokens;
        tokens = NULL;
        rep->n_tokens = context;
        rep->prefill_tokens = n_prefill;
        rep->seconds_seed = t1 - t0;
        rep->seconds_prefill = t2 - t1;
        rep->seconds_tau = t3 - t2;
    }
    if (st) fr_calib_free(out);
    fr_runner_destroy(&r);
    fr_kv_cache_destroy(&kv);
    for (int i = 0; cont && i < n_texts; i++) free(cont[i]);
    free(cont); free(plen); free(n_cont); free(tokens); free(logits);
    free(cs.ksum); free(cs.amax); free(cs.scratch); free(cs.keys);
    return st;
}
