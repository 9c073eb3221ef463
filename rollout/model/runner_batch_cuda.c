/* The CUDA runner behind runner.h: batches forwarded to runner_cuda.h,
 * their sampling parameters in the device sampler's form. Built only with
 * CUDA (runner_nocuda.c stands in without). */
#include "rollout/model/runner.h"

#include <stdlib.h>
#include <string.h>

#include "rollout/model/runner_cuda.h"

typedef struct {
    fr_runner base;
    fr_runner_cuda *gpu;
    /* A batch's draws in the device sampler's form, grown to the largest
     * batch (no allocation per step once the batches stop growing). */
    fr_sample_row *params;
    int *draw_rows;
    int cap;
} cuda_runner;

/* Defined at the end, after the functions it names; fr_runner_cuda_of tells
 * this backend's runners by it. */
static const fr_runner_ops cuda_ops;

static cuda_runner *cuda_of(fr_runner *r) { return (cuda_runner *)r; }

fr_runner_cuda *fr_runner_cuda_of(fr_runner *r) { return r && r->ops == &cuda_ops ? cuda_of(r)->gpu : NULL; }

/* Room for n draws (at least one). */
static fr_status room(cuda_runner *r, int n)
{
    if (n < 1) n = 1;
    if (n <= r->cap) return FR_OK;
    fr_sample_row *p = realloc(r->params, sizeof *p * (size_t)n);
    if (p) r->params = p;
    int *rows = p ? realloc(r->draw_rows, sizeof *rows * (size_t)n) : NULL;
    if (rows) r->draw_rows = rows;
    if (!p || !rows) return fr_fail(FR_ENOMEM, "out of memory");
    r->cap = n;
    return FR_OK;
}

static void cuda_destroy(fr_runner *base)
{
    cuda_runner *r = cuda_of(base);
    fr_runner_cuda_destroy(&r->gpu);
    free(r->params);
    free(r->draw_rows);
    free(r);
}

static fr_sample_row sample_row(const fr_decode_row *d)
{
    return (fr_sample_row){.temperature = d->params.temperature, .top_k = d->params.top_k, .top_p = d->params.top_p,
                           .seed = d->params.seed, .sequence = d->sequence, .step = d->step};
}

/* The decode rows of b in r->params. */
static fr_status decode_params(cuda_runner *r, const fr_batch *b)
{
    fr_status st = room(r, b->n_seqs);
    for (int i = 0; i < b->n_seqs && !st; i++) r->params[i] = sample_row(&b->rows[i]);
    return st;
}

static fr_status step_draw(cuda_runner *r, const fr_batch *b)
{
    fr_status st = room(r, b->n_draws);
    for (int i = 0; i < b->n_draws && !st; i++) {
        r->draw_rows[i] = b->draws[i].row;
        r->params[i] = sample_row(&b->draws[i].d);
    }
    if (st) return st;
    return fr_runner_cuda_step_draw(r->gpu, b->seqs, b->n_seqs, r->draw_rows, r->params, b->n_draws, b->tokens,
                                    b->logprobs, b->keep, b->n_keep, b->kept_logits);
}

static fr_status decode(cuda_runner *r, const fr_batch *b)
{
    if (b->phase == FR_RUN_WAIT)
        return fr_runner_cuda_decode_wait(r->gpu, b->seqs, b->n_seqs, b->tokens, b->logprobs, b->keep, b->n_keep,
                                          b->kept_logits);
    fr_runner_cuda *rider = NULL;
    if (b->phase == FR_RUN_LAUNCH && b->rider && !(rider = fr_runner_cuda_of(b->rider)))
        return fr_fail(FR_EUNSUPPORTED, "a decode carrying another session's needs the CUDA backend");
    fr_status st = decode_params(r, b);
    if (st) return st;
    if (b->phase == FR_RUN_WHOLE)
        return fr_runner_cuda_decode_keep(r->gpu, b->seqs, r->params, b->n_seqs, b->tokens, b->logprobs, b->keep,
                                          b->n_keep, b->kept_logits);
    if (rider)
        return fr_runner_cuda_decode_launch_carrying(r->gpu, b->seqs, r->params, b->n_seqs, rider, b->rider_seqs,
                                                     b->n_rider);
    return fr_runner_cuda_decode_launch(r->gpu, b->seqs, r->params, b->n_seqs);
}

static fr_status cuda_run(fr_runner *base, const fr_batch *b)
{
    cuda_runner *r = cuda_of(base);
    switch (b->kind) {
    case FR_BATCH_FILL:
        return fr_runner_cuda_fill(r->gpu, b->seqs, b->n_seqs);
    case FR_BATCH_STEP:
        return b->logits ? fr_runner_cuda_step(r->gpu, b->seqs, b->n_seqs, b->logits) : step_draw(r, b);
    case FR_BATCH_DECODE:
        return decode(r, b);
    }
    return fr_fail(FR_EINVAL, "CUDA runner: unknown batch kind %d", (int)b->kind);
}

static fr_status cuda_fork(fr_runner *base, int src_seq, int dst_seq)
{
    return fr_runner_cuda_fork(cuda_of(base)->gpu, src_seq, dst_seq);
}

static fr_status cuda_set_key_mean(fr_runner *base, const float *key_mean)
{
    return fr_runner_cuda_set_key_mean(cuda_of(base)->gpu, key_mean);
}

static fr_status cuda_set_observer(fr_runner *base, const fr_forward_observer *obs)
{
    return fr_runner_cuda_set_observer(cuda_of(base)->gpu, obs);
}

static fr_status cuda_set_deterministic(fr_runner *base, int on)
{
    return fr_runner_cuda_set_deterministic(cuda_of(base)->gpu, on);
}

/* Device weights change in place (rollout/engine/weight_stage.h): the
 * runner reads them where they are. */
static fr_status cuda_weights_changed(fr_runner *base)
{
    (void)base;
    return FR_OK;
}

/* The device keeps every layer's choices in any case (moe_cuda.h): there is
 * nothing to switch, only a model without experts to refuse. */
static fr_status cuda_capture_routes(fr_runner *base, int on)
{
    const fr_model_config *c = fr_runner_cuda_config(cuda_of(base)->gpu);
    if (on && fr_model_moe_layers(c) == 0)
        return fr_fail(FR_EINVAL, "routed experts: the model has no mixture-of-experts layer");
    return FR_OK;
}

static fr_status cuda_routes(fr_runner *base, const int *rows, int n, uint16_t *out)
{
    return fr_runner_cuda_routes(cuda_of(base)->gpu, rows, n, out);
}

static void cuda_capture_stats(const fr_runner *base, int *captures, double *seconds)
{
    fr_runner_cuda_capture_stats(((const cuda_runner *)base)->gpu, captures, seconds);
}

fr_status fr_runner_cuda_open(const fr_runner_config *c, fr_runner **out)
{
    fr_status st = fr_runner_backend_new("fr_runner_cuda_open", c, &cuda_ops, 1, sizeof(cuda_runner), out);
    if (st) return st;
    cuda_runner *r = cuda_of(*out);
    st = fr_runner_cuda_new_tp(c->gpu, c->kv, c->max_step_tokens, c->nccl, &r->gpu);
    /* Off is the runner's default: only a change is asked for. */
    if (!st && c->deterministic) st = fr_runner_cuda_set_deterministic(r->gpu, 1);
    if (!st) st = room(r, fr_kv_cache_config_of(c->kv)->max_seqs);
    if (st) {
        cuda_destroy(*out);
        *out = NULL;
    }
    return st;
}

static fr_status cuda_memory(fr_runner *base, int release)
{
    return fr_runner_cuda_memory(cuda_of(base)->gpu, release);
}

static const fr_runner_ops cuda_ops = {
    .run = cuda_run,
    .fork = cuda_fork,
    .set_key_mean = cuda_set_key_mean,
    .set_observer = cuda_set_observer,
    .set_deterministic = cuda_set_deterministic,
    .weights_changed = cuda_weights_changed,
    .capture_routes = cuda_capture_routes,
    .routes = cuda_routes,
    .capture_stats = cuda_capture_stats,
    .memory = cuda_memory,
    .destroy = cuda_destroy,
};
