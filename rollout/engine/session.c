/* Sessions: a model, its KV cache and a runner (rollout/model/runner.h) on
 * the backend the options pick. Opening chooses the backend and where the
 * weights live (session_device.h for the device's); every step after that
 * is a batch handed to the runner, which samples where its logits are. */
#include "rollout/engine/session.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "kvcache/page_layout.h"
#include "rollout/engine/session_device.h"

void fr_engine_opts_default(fr_engine_opts *o)
{
    *o = (fr_engine_opts){.model = "synthetic:tiny", .backend = FR_BACKEND_AUTO, .kv = FR_KV_BF16, .compute = FR_COMPUTE_AUTO,
                          .recipe = fr_recipe_full(), .calib = NULL, .chunk = 512,
                          .tp = 1, .group = NULL, .deterministic = 0};
}

fr_fp4_compute fr_fp4_compute_for(fr_fp4_compute c, fr_backend b)
{
    if (c != FR_COMPUTE_AUTO) return c;
    return b == FR_BACKEND_CUDA ? FR_COMPUTE_BF16 : FR_COMPUTE_EXACT;
}

const char *fr_backend_name(fr_backend b)
{
    return b == FR_BACKEND_CPU ? "cpu" : b == FR_BACKEND_CUDA ? "cuda" : "auto";
}

/* One block's bytes in dtype kv: every layer's page of n_kv_heads heads, or of the latent row. */
static size_t block_bytes_of(const fr_model_config *c, int n_kv_heads, fr_kv_dtype kv)
{
    const fr_page_layout lay = fr_model_is_mla(c) ? fr_page_layout_latent(kv, c->kv_lora_rank, c->qk_rope_dim)
                                                  : fr_page_layout_for(kv, c->head_dim);
    return lay.head_page_bytes * (size_t)c->num_layers * (size_t)(fr_model_is_mla(c) ? 1 : n_kv_heads);
}

fr_status fr_kv_blocks_for_memory(const fr_model_config *c, int n_kv_heads, fr_kv_dtype kv, size_t free_bytes,
                                  size_t total_bytes, double fraction, double shadow_share, int max_seqs,
                                  fr_kv_sizing *out)
{
    if (!c || !out || n_kv_heads < 1 || max_seqs < 1 || free_bytes > total_bytes || !(shadow_share >= 0.0))
        return fr_fail(FR_EINVAL, "kv_memory_fraction: bad arguments");
    if (!(fraction > 0.0 && fraction <= 1.0))
        return fr_fail(FR_EINVAL, "kv_memory_fraction %g is not in (0, 1]", fraction);
    const double r = shadow_share > 1.0 ? 1.0 : shadow_share;
    const size_t block = block_bytes_of(c, n_kv_heads, kv), sblock = block_bytes_of(c, n_kv_heads, FR_KV_BF16);
    const double share = fraction * (double)total_bytes, used = (double)(total_bytes - free_bytes);
    const double room = share > used ? share - used : 0.0;
    /* n x block + r n x sblock = room; the shadow at least one block a slot */
    double n = room / ((double)block + r * (double)sblock), ns = r > 0.0 ? ceil(r * n) : 0.0;
    if (r > 0.0 && ns < max_seqs) {
        ns = max_seqs;
        n = (room - ns * (double)sblock) / (double)block;
    }
    n = floor(n > 0.0 ? n : 0.0);
    if (n < (double)max_seqs)
        return fr_fail(FR_ENOMEM, "kv_memory_fraction %g of the device's %.2f GB is %.2f GB, and %.2f GB are in use "
                       "already (weights and the rest): room for %lld KV blocks of %zu bytes%s, fewer than the %d "
                       "sequence slots; raise kv_memory_fraction, lower max_seqs or give kv_blocks",
                       fraction, total_bytes / 1e9, share / 1e9, used / 1e9, (long long)n, block,
                       r > 0.0 ? " beside the monitoring shadow's" : "", max_seqs);
    *out = (fr_kv_sizing){.n_blocks = n > 2147483647.0 ? 2147483647 : (int)n,
                          .shadow_blocks = r > 0.0 ? (ns > 2147483647.0 ? 2147483647 : (int)ns) : max_seqs,
                          .block_bytes = block, .shadow_block_bytes = sblock};
    return FR_OK;
}

/* n_blocks for a session whose cache is sized by o->kv_memory_fraction: the
 * device's memory now that the weights are on it, this rank's KV heads. */
static fr_status blocks_by_memory(const fr_engine_opts *o, const fr_model *m, int max_seqs, int *n_blocks,
                                  int *shadow_blocks)
{
    if (o->tp > 1)
        return fr_fail(FR_EUNSUPPORTED, "kv_memory_fraction with tp %d: the ranks of an engine must agree on the "
                                        "cache's size; give kv_blocks", o->tp);
    size_t free_b = 0, total = 0;
    fr_kv_sizing z;
    fr_status st = fr_session_device_free_memory(&free_b, &total);
    if (!st) st = fr_kv_blocks_for_memory(&m->cfg, m->cfg.num_kv_heads, o->kv, free_b, total, o->kv_memory_fraction,
                                         o->kv_shadow_share, max_seqs, &z);
    if (st) return st;
    *n_blocks = z.n_blocks;
    *shadow_blocks = z.shadow_blocks;
    fr_info("kv_memory_fraction %g: %d KV blocks of %zu bytes (%.2f GB), a monitoring shadow's %d BF16 blocks of %zu "
            "(%.2f GB%s); %.2f of the device's %.2f GB were in use", o->kv_memory_fraction, z.n_blocks, z.block_bytes,
            (double)z.n_blocks * z.block_bytes / 1e9, z.shadow_blocks, z.shadow_block_bytes,
            (double)z.shadow_blocks * z.shadow_block_bytes / 1e9,
            o->kv_shadow_share > 0 ? "" : ", when a request asks for one, outside the share", (total - free_b) / 1e9,
            total / 1e9);
    return FR_OK;
}

/* n_blocks 0 with kv_memory_fraction: on the GPU the blocks that share of its
 * memory holds now that the weights are on it; on the CPU (a model --backend auto
 * sends there) a fixed share per sequence slot, since the device's memory says
 * nothing of the host's. Otherwise n_blocks as given. */
static fr_status size_cache(const fr_engine_opts *o, fr_backend b, const fr_model *m, int max_seqs, int *n_blocks,
                            int *shadow_blocks)
{
    if (*n_blocks != 0 || !(o->kv_memory_fraction > 0)) return FR_OK;
    if (b == FR_BACKEND_CUDA) return blocks_by_memory(o, m, max_seqs, n_blocks, shadow_blocks);
    *n_blocks = max_seqs * FR_SESSION_PAGES_PER_SEQ;
    fr_info("the model runs on the CPU: %d KV blocks (%d per sequence slot), not kv_memory_fraction's", *n_blocks,
            FR_SESSION_PAGES_PER_SEQ);
    return FR_OK;
}

/* The session's runner over its cache: on the device when the session has
 * device weights, else on the CPU. */
static fr_status open_runner(fr_session *s, int step_tokens)
{
    fr_runner_config rc = {.model = s->model, .gpu = s->gpu_weights, .kv = s->kv, .max_step_tokens = step_tokens,
                           .tp = &s->tp, .nccl = s->nccl, .deterministic = s->deterministic};
    return fr_runner_open(&rc, &s->runner);
}

/* Builds the cache and the runner for model m on backend b (CPU or CUDA).
 * On the CUDA backend, s->gpu_weights holds the device weights (made by
 * fr_session_device_load or _adopt; the session owns them) and m only its
 * config. */
static fr_status open_on(const fr_engine_opts *o, fr_backend b, fr_model *m, int n_blocks, int max_seqs,
                         fr_session *s)
{
    struct fr_weights_gpu *wg = s->gpu_weights;
    struct fr_nccl_group *nccl = s->nccl;   /* made before the weights */
    memset(s, 0, sizeof *s);
    s->nccl = nccl;
    s->model = m;
    s->backend = b;
    s->deterministic = o->deterministic;
    s->gpu_weights = wg;
    s->tp = (fr_tp){.rank = o->tp > 1 ? o->group->layout.tp_rank : 0, .size = o->tp,
                    .group = o->tp > 1 ? o->group : NULL};
    fr_status st = size_cache(o, b, m, max_seqs, &n_blocks, &s->shadow_blocks);
    if (st) return st;
    if (o->calib) {
        if ((st = fr_calib_load(o->calib, fr_model_calib_dims(&m->cfg), &s->calib))) return st;
        s->has_calib = 1;
    }
    /* Tensor parallel: this rank's KV heads, and their rows of the
     * calibration tables. */
    fr_tp_layout tl;
    if ((st = fr_tp_layout_of(&m->cfg, s->tp.rank, s->tp.size, &tl))) return st;
    const int L = m->cfg.num_layers;
    float *key_mean = NULL, *fp8_scales = NULL;
    if (s->has_calib && s->tp.size > 1) {
        key_mean = malloc(sizeof(float) * (size_t)L * tl.n_kv_heads * m->cfg.head_dim);
        fp8_scales = malloc(sizeof(float) * (size_t)L * tl.n_kv_heads * 2);
        if (!key_mean || !fp8_scales) {
            free(key_mean); free(fp8_scales);
            return fr_fail(FR_ENOMEM, "out of memory");
        }
        fr_tp_slice_kv_table(s->calib.key_mean, L, m->cfg.num_kv_heads, m->cfg.head_dim, &tl, key_mean);
        if (s->calib.fp8_scales) fr_tp_slice_kv_table(s->calib.fp8_scales, L, m->cfg.num_kv_heads, 2, &tl, fp8_scales);
    }
    /* The device runner keeps the pages on the device: the host cache keeps
     * its sequences and block tables only. */
    fr_kv_cache_config kc = {
        .n_layers = L, .n_kv_heads = tl.n_kv_heads, .head_dim = m->cfg.head_dim,
        .latent_dim = m->cfg.kv_lora_rank, .dtype = o->kv, .compute = fr_fp4_compute_for(o->compute, b), .recipe = o->recipe,
        .tau = s->has_calib ? s->calib.tau : FR_P_TAU, .n_blocks = n_blocks, .max_seqs = max_seqs,
        .key_mean = !s->has_calib ? NULL : key_mean ? key_mean : s->calib.key_mean,
        .fp8_scales = !s->has_calib || !s->calib.fp8_scales ? NULL : fp8_scales ? fp8_scales : s->calib.fp8_scales,
        .bookkeeping_only = wg != NULL,
    };
    const int step_tokens = o->chunk > max_seqs ? o->chunk : max_seqs;
    st = fr_kv_cache_new(&kc, &s->kv);   /* copies the tables */
    free(key_mean);
    free(fp8_scales);
    return st ? st : open_runner(s, step_tokens);
}

/* The options' tensor parallelism against their engine group. */
static fr_status check_tp(const fr_engine_opts *o)
{
    if (o->tp < 1) return fr_fail(FR_EINVAL, "--tp %d must be >= 1", o->tp);
    if (o->tp == 1) return FR_OK;
    if (!o->group)
        return fr_fail(FR_EINVAL, "--tp %d needs the %d ranks of an engine: launch under mpirun (generate "
                                  "and score set this up)", o->tp, o->tp);
    if (o->group->layout.tp_size != o->tp)
        return fr_fail(FR_EINVAL, "--tp %d does not match the engine group's %d ranks", o->tp,
                       o->group->layout.tp_size);
    return FR_OK;
}

/* The backend a session should use, before anything is loaded. With tensor
 * parallelism (tp > 1, checked by check_tp) auto picks the CPU; the GPU
 * engine is asked for with --backend cuda (one GPU per rank). */
static fr_status resolve_backend(const fr_engine_opts *o, fr_backend *out)
{
    fr_status st = check_tp(o);
    if (st) return st;
    if (o->deterministic && o->backend == FR_BACKEND_CUDA && o->tp > 1)
        return fr_fail(FR_EUNSUPPORTED, "deterministic mode on the GPU runs with one GPU per engine (--tp 1): NCCL's "
                                        "all-reduce order depends on the message size (docs/determinism.md)");
    if (o->tp > 1 && o->backend == FR_BACKEND_AUTO) {
        *out = FR_BACKEND_CPU;
        return FR_OK;
    }
    return fr_backend_pick(o->backend, out);
}

fr_status fr_backend_pick(fr_backend want, fr_backend *out)
{
    const int gpu = fr_cuda_available();
    if (want == FR_BACKEND_CUDA && !gpu) return fr_fail(FR_EUNSUPPORTED, "--backend cuda: %s", fr_cuda_absence());
    *out = want == FR_BACKEND_AUTO ? (gpu ? FR_BACKEND_CUDA : FR_BACKEND_CPU) : want;
    return FR_OK;
}

/* Whether a failure to open on backend b sends the session to the CPU:
 * auto, and the GPU refused the configuration. */
static int falls_back(const fr_engine_opts *o, fr_backend b, fr_status st)
{
    return o->backend == FR_BACKEND_AUTO && b != FR_BACKEND_CPU && st == FR_EUNSUPPORTED;
}

fr_status fr_session_open_model(const fr_engine_opts *o, fr_model *m, int n_blocks, int max_seqs,
                                fr_session *s)
{
    fr_backend b = FR_BACKEND_CPU;
    fr_status st = resolve_backend(o, &b);
    if (st) return st;
    memset(s, 0, sizeof *s);
    if (b == FR_BACKEND_CUDA && (st = fr_session_device_adopt(o, s, m))) return st;
    st = open_on(o, b, m, n_blocks, max_seqs, s);
    if (st && falls_back(o, b, st)) {
        s->model = NULL;   /* the caller's model: keep it */
        fr_session_close(s);
        st = open_on(o, FR_BACKEND_CPU, m, n_blocks, max_seqs, s);
    }
    if (st) {
        s->model = NULL;
        fr_session_close(s);
    }
    return st;
}

/* --max-model-len: a shorter window than the model's sizes every buffer
 * that scales with it (rope tables, GPU page tables and workspaces). */
static void cap_context(const fr_engine_opts *o, fr_model *m)
{
    if (o->max_model_len > 0 && o->max_model_len < m->cfg.max_position) m->cfg.max_position = o->max_model_len;
}

fr_status fr_session_open(const fr_engine_opts *o, int n_blocks, int max_seqs, fr_session *s)
{
    memset(s, 0, sizeof *s);
    fr_backend b = FR_BACKEND_CPU;
    fr_status st = resolve_backend(o, &b);
    if (st) return st;
    fr_model *m = NULL;
    if (b == FR_BACKEND_CUDA) {
        if ((st = fr_session_device_load(o, s, &m))) return st;
        cap_context(o, m);
        st = open_on(o, b, m, n_blocks, max_seqs, s);
        if (!st) return FR_OK;
        fr_session_close(s);   /* frees m and the device weights */
        if (!falls_back(o, b, st)) return st;
        b = FR_BACKEND_CPU;    /* auto: this configuration runs on the CPU only */
    }
    if ((st = fr_model_load(o->model, &m))) return st;
    cap_context(o, m);
    st = open_on(o, b, m, n_blocks, max_seqs, s);
    if (st) fr_session_close(s);
    return st;
}

void fr_session_capture_stats(const fr_session *s, int *captures, double *seconds)
{
    fr_runner_capture_stats(s ? s->runner : NULL, captures, seconds);
}

void fr_session_close(fr_session *s)
{
    fr_runner_destroy(&s->runner);
    if (!s->borrowed) fr_session_device_release(s);
    fr_kv_cache_destroy(&s->kv);
    if (s->has_calib) fr_calib_free(&s->calib);
    if (!s->borrowed) fr_model_destroy(&s->model);
    memset(s, 0, sizeof *s);
}

fr_status fr_session_open_shadow(const fr_session *main, int n_blocks, int max_seqs, int step_tokens,
                                 fr_session *out)
{
    if (!main || !out || !main->kv) return fr_fail(FR_EINVAL, "fr_session_open_shadow: no session");
    if (n_blocks < 1 || max_seqs < 1 || step_tokens < 1)
        return fr_fail(FR_EINVAL, "shadow session: %d blocks, %d sequences, %d step tokens must all be >= 1",
                       n_blocks, max_seqs, step_tokens);
    memset(out, 0, sizeof *out);
    out->borrowed = 1;
    out->model = main->model;
    out->backend = main->backend;
    out->gpu_weights = main->gpu_weights;
    out->nccl = main->nccl;
    out->tp = main->tp;
    out->deterministic = main->deterministic;
    fr_kv_cache_config kc = *fr_kv_cache_config_of(main->kv);
    kc.dtype = FR_KV_BF16;
    kc.compute = FR_COMPUTE_EXACT;
    kc.key_mean = NULL;
    kc.fp8_scales = NULL;
    kc.n_blocks = n_blocks;
    kc.max_seqs = max_seqs;
    fr_status st = fr_kv_cache_new(&kc, &out->kv);
    if (!st) st = open_runner(out, step_tokens);
    if (st) fr_session_close(out);
    return st;
}

fr_status fr_session_release_memory(fr_session *s, int weights)
{
    if (!s || !s->kv || !s->runner) return fr_fail(FR_EINVAL, "fr_session_release_memory: no session");
    if (s->tp.size > 1)
        return fr_fail(FR_EUNSUPPORTED, "releasing the memory of a tensor-parallel engine (tp %d) is not supported",
                       s->tp.size);
    if (s->released) return FR_OK;
    fr_status st = fr_kv_cache_release_memory(s->kv);   /* refuses while a sequence is live */
    if (!st) st = fr_runner_memory(s->runner, 1);
    if (!st && weights) st = fr_session_device_memory(s, 1);
    if (st) {
        char why[512];
        snprintf(why, sizeof why, "%s", fr_last_error());
        fr_session_device_memory(s, 0);   /* whatever was given back is taken again */
        fr_runner_memory(s->runner, 0);
        fr_kv_cache_restore_memory(s->kv);
        return fr_fail(st, "%s", why);
    }
    s->released = weights ? 2 : 1;
    return FR_OK;
}

fr_status fr_session_resume_memory(fr_session *s)
{
    if (!s || !s->kv || !s->runner) return fr_fail(FR_EINVAL, "fr_session_resume_memory: no session");
    if (!s->released) return FR_OK;
    fr_status st = fr_session_device_memory(s, 0);
    if (!st) st = fr_runner_memory(s->runner, 0);
    if (!st) st = fr_kv_cache_restore_memory(s->kv);
    if (!st) s->released = 0;
    return st;
}

fr_status fr_session_set_key_mean(fr_session *s, const float *key_mean)
{
    if (!s || !s->kv || !s->model || !key_mean) return fr_fail(FR_EINVAL, "fr_session_set_key_mean: NULL argument");
    if (s->tp.size > 1)
        return fr_fail(FR_EUNSUPPORTED, "changing the key mean of a tensor-parallel engine (tp %d) is not supported",
                       s->tp.size);
    const fr_model_config *mc = &s->model->cfg;
    const size_t n = (size_t)mc->num_layers * mc->num_kv_heads * mc->head_dim;
    float *copy = s->has_calib ? NULL : malloc(sizeof(float) * n);
    if (!s->has_calib && !copy) return fr_fail(FR_ENOMEM, "out of memory");
    fr_status st = fr_kv_cache_set_key_mean(s->kv, key_mean);   /* checks the values first */
    if (!st && s->runner) st = fr_runner_set_key_mean(s->runner, key_mean);
    if (st) {
        free(copy);
        return st;
    }
    if (!s->has_calib) {
        s->calib.key_mean = copy;
        s->calib.tau = fr_kv_cache_config_of(s->kv)->tau;
        s->calib.has_tau = 1;
        s->calib.fp8_scales = NULL;
        s->has_calib = 1;
    }
    memcpy(s->calib.key_mean, key_mean, sizeof(float) * n);
    return FR_OK;
}

fr_status fr_session_step(fr_session *s, const fr_step_seq *seqs, int n_seqs, float *logits)
{
    const fr_batch b = {.kind = FR_BATCH_STEP, .seqs = seqs, .n_seqs = n_seqs, .logits = logits};
    return fr_runner_run(s->runner, &b);
}

fr_status fr_session_fill(fr_session *s, const fr_step_seq *seqs, int n_seqs)
{
    if (!s || n_seqs < 1 || !seqs) return fr_fail(FR_EINVAL, "fr_session_fill: bad argument");
    const fr_batch b = {.kind = FR_BATCH_FILL, .seqs = seqs, .n_seqs = n_seqs};
    return fr_runner_run(s->runner, &b);
}

fr_status fr_session_decode(fr_session *s, const fr_step_seq *seqs, const fr_decode_row *rows, int n_seqs,
                            int *tokens, float *logprobs)
{
    return fr_session_decode_keep(s, seqs, rows, n_seqs, tokens, logprobs, NULL, 0, NULL);
}

fr_status fr_session_decode_keep(fr_session *s, const fr_step_seq *seqs, const fr_decode_row *rows, int n_seqs,
                                 int *tokens, float *logprobs, const int *keep, int n_keep, float *kept_logits)
{
    if (!s || n_seqs < 0 || (n_seqs && (!seqs || !rows)))
        return fr_fail(FR_EINVAL, "fr_session_decode: bad argument");
    if (n_keep < 0 || n_keep > n_seqs || (n_keep && (!keep || !kept_logits)))
        return fr_fail(FR_EINVAL, "fr_session_decode: bad list of rows whose logits to keep");
    const fr_batch b = {.kind = FR_BATCH_DECODE, .seqs = seqs, .n_seqs = n_seqs, .rows = rows, .keep = keep,
                        .n_keep = n_keep, .tokens = tokens, .logprobs = logprobs, .kept_logits = kept_logits};
    return fr_runner_run(s->runner, &b);
}

fr_status fr_session_decode_launch(fr_session *s, const fr_step_seq *seqs, const fr_decode_row *rows, int n_seqs)
{
    if (!s || n_seqs < 1 || !seqs || !rows) return fr_fail(FR_EINVAL, "fr_session_decode_launch: bad argument");
    const fr_batch b = {.kind = FR_BATCH_DECODE, .phase = FR_RUN_LAUNCH, .seqs = seqs, .n_seqs = n_seqs, .rows = rows};
    return fr_runner_run(s->runner, &b);
}

fr_status fr_session_decode_launch_carrying(fr_session *s, const fr_step_seq *seqs, const fr_decode_row *rows,
                                            int n_seqs, fr_session *rider, const fr_step_seq *rider_seqs, int n_rider)
{
    if (!s || n_seqs < 1 || !seqs || !rows || !rider)
        return fr_fail(FR_EINVAL, "fr_session_decode_launch_carrying: bad argument");
    if (!rider->runner)
        return fr_fail(FR_EUNSUPPORTED, "a decode carrying another session's needs the CUDA backend");
    const fr_batch b = {.kind = FR_BATCH_DECODE, .phase = FR_RUN_LAUNCH, .seqs = seqs, .n_seqs = n_seqs,
                        .rows = rows, .rider = rider->runner, .rider_seqs = rider_seqs, .n_rider = n_rider};
    return fr_runner_run(s->runner, &b);
}

fr_status fr_session_decode_wait(fr_session *s, const fr_step_seq *seqs, int n_seqs, int *tokens, float *logprobs,
                                 const int *keep, int n_keep, float *kept_logits)
{
    if (!s || n_seqs < 1 || !seqs) return fr_fail(FR_EINVAL, "fr_session_decode_wait: bad argument");
    const fr_batch b = {.kind = FR_BATCH_DECODE, .phase = FR_RUN_WAIT, .seqs = seqs, .n_seqs = n_seqs, .keep = keep,
                        .n_keep = n_keep, .tokens = tokens, .logprobs = logprobs, .kept_logits = kept_logits};
    return fr_runner_run(s->runner, &b);
}

fr_status fr_session_step_draw(fr_session *s, const fr_step_seq *seqs, int n_seqs, const fr_step_draw *draws,
                               int n_draws, int *tokens, float *logprobs, const int *keep, int n_keep,
                               float *kept_logits)
{
    if (!s || n_seqs < 0 || (n_seqs && !seqs) || n_draws < 0 || (n_draws && (!draws || !tokens)) || n_keep < 0 ||
        (n_keep && (!keep || !kept_logits)))
        return fr_fail(FR_EINVAL, "fr_session_step_draw: bad argument");
    const fr_batch b = {.kind = FR_BATCH_STEP, .seqs = seqs, .n_seqs = n_seqs, .draws = draws, .n_draws = n_draws,
                        .keep = keep, .n_keep = n_keep, .tokens = tokens, .logprobs = logprobs,
                        .kept_logits = kept_logits};
    return fr_runner_run(s->runner, &b);
}

fr_status fr_session_capture_routes(fr_session *s, int on)
{
    if (!s || !s->runner) return fr_fail(FR_EINVAL, "fr_session_capture_routes: no session");
    return fr_runner_capture_routes(s->runner, on);
}

fr_status fr_session_routes(fr_session *s, const int *rows, int n, uint16_t *out)
{
    if (!s || !s->runner) return fr_fail(FR_EINVAL, "fr_session_routes: no session");
    return fr_runner_routes(s->runner, rows, n, out);
}

fr_status fr_session_fork(fr_session *s, int src, int *dst)
{
    fr_status st = fr_kv_seq_fork(s->kv, src, dst);
    if (!st && (st = fr_runner_fork(s->runner, src, *dst))) fr_kv_seq_free(s->kv, *dst);
    return st;
}

fr_status fr_session_prefill(fr_session *s, const int *tokens, int n, int chunk, int *seq,
                             float *last_logits, float *all_logits)
{
    const int V = s->model->cfg.vocab_size;
    fr_status st = fr_kv_seq_new(s->kv, seq);
    if (st) return st;
    for (int i = 0; i < n && !st; i += chunk) {
        int m = n - i < chunk ? n - i : chunk;
        fr_step_seq step = {.seq = *seq, .n = m, .tokens = tokens + i, .all_logits = all_logits != NULL};
        float *out = all_logits ? all_logits + (size_t)i * V : last_logits;
        st = fr_session_step(s, &step, 1, out);
        if (!st && all_logits && i + m == n && last_logits)
            memcpy(last_logits, all_logits + (size_t)(n - 1) * V, sizeof(float) * (size_t)V);
    }
    if (st) fr_kv_seq_free(s->kv, *seq);
    return st;
}

/* One separator of an id list: white space, or one comma with white space
 * around it. Returns the separator's end; *comma says whether it held one. */
static const char *skip_separator(const char *p, int *comma)
{
    *comma = 0;
    while (isspace((unsigned char)*p)) p++;
    if (*p == ',') {
        *comma = 1;
        p++;
        while (isspace((unsigned char)*p)) p++;
    }
    return p;
}

fr_status fr_parse_ids(const char *text, int **ids, int *n)
{
    int cap = 64, count = 0, comma = 0;
    int *out = malloc(sizeof(int) * (size_t)cap);
    if (!out) return fr_fail(FR_ENOMEM, "out of memory");
    const char *p = skip_separator(text, &comma);
    fr_status st = comma ? fr_fail(FR_EINVAL, "token ids: a list cannot start with a comma") : FR_OK;
    while (!st && *p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > 0x7fffffff || *p == '+' ||
            (*end && !isspace((unsigned char)*end) && *end != ',')) {
            st = fr_fail(FR_EINVAL, "token ids: '%.20s' is not a non-negative integer", p);
            break;
        }
        if (count == cap) {
            int *grown = realloc(out, sizeof(int) * (size_t)(cap *= 2));
            if (!grown) { st = fr_fail(FR_ENOMEM, "out of memory"); break; }
            out = grown;
        }
        out[count++] = (int)v;
        p = skip_separator(end, &comma);
        if (comma && (!*p || *p == ','))   /* "1,,2" and "1,2," name no id */
            st = fr_fail(FR_EINVAL, "token ids: an empty entry after id %d (entry %d)", (int)v, count);
    }
    if (st) {
        free(out);
        return st;
    }
    *ids = out;
    *n = count;
    return FR_OK;
}

fr_status fr_read_ids_file(const char *path, int **ids, int *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fr_fail(FR_EIO, "cannot read %s", path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = size >= 0 ? malloc((size_t)size + 1) : NULL;
    fr_status st = FR_OK;
    if (!buf || fread(buf, 1, (size_t)size, f) != (size_t)size) st = fr_fail(FR_EIO, "cannot read %s", path);
    fclose(f);
    if (!st) {
        buf[size] = 0;
        st = fr_parse_ids(buf, ids, n);
        if (st) st = fr_fail(st, "%s: %s", path, fr_last_error());
    }
    free(buf);
    return st;
}

fr_status fr_check_prompt(const fr_model_config *cfg, const int *ids, int n, int extra)
{
    if (n < 1) return fr_fail(FR_EINVAL, "the prompt is empty");
    for (int i = 0; i < n; i++)
        if (ids[i] >= cfg->vocab_size)
            return fr_fail(FR_EINVAL, "prompt token %d is id %d, outside the vocabulary of %d", i, ids[i],
                           cfg->vocab_size);
    if (n >= cfg->max_position || (long)n + extra > cfg->max_position)
        return fr_fail(FR_EINVAL, "the prompt (%d tokens) plus %d new tokens exceeds the context window of %d",
                       n, extra, cfg->max_position);
    return FR_OK;
}
