/* The CPU runner behind runner.h: a batch is one fr_runner_cpu_step, and
 * its tokens are drawn on the host from the step's logits with fr_sample
 * (the rules and draws the GPU sampler reproduces). */
#include "rollout/model/runner.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    fr_runner base;
    fr_runner_cpu *cpu;
    int vocab;
    fr_sampler *sampler;        /* made on the first batch that draws */
    float *logits;              /* the step's logits, grown to the largest batch */
    int logit_rows;
} cpu_runner;

static cpu_runner *cpu_of(fr_runner *r) { return (cpu_runner *)r; }

/* The logits rows for a step of `rows` rows, and the sampler when tokens
 * are drawn. */
static fr_status step_room(cpu_runner *r, int rows, int sampling)
{
    const int V = r->vocab;
    fr_status st;
    if (sampling && !r->sampler && (st = fr_sampler_new(V, &r->sampler))) return st;
    if (r->logit_rows < rows) {
        float *grown = realloc(r->logits, sizeof(float) * (size_t)V * (size_t)rows);
        if (!grown) return fr_fail(FR_ENOMEM, "out of memory");
        r->logits = grown;
        r->logit_rows = rows;
    }
    return FR_OK;
}

/* Logit rows keep[0..n_keep) of the step to kept (rows checked). */
static void copy_kept(const cpu_runner *r, const int *keep, int n_keep, float *kept)
{
    const size_t V = (size_t)r->vocab;
    for (int i = 0; i < n_keep; i++) memcpy(kept + (size_t)i * V, r->logits + (size_t)keep[i] * V, sizeof(float) * V);
}

/* A decode: one step, then seqs[i]'s token drawn from row i with rows[i]. */
static fr_status decode(cpu_runner *r, const fr_batch *b)
{
    const int V = r->vocab, n_seqs = b->n_seqs;
    for (int i = 0; i < b->n_keep; i++)
        if (b->keep[i] < 0 || b->keep[i] >= n_seqs)
            return fr_fail(FR_EINVAL, "decode: row %d to keep is outside the batch of %d", b->keep[i], n_seqs);
    for (int i = 0; i < n_seqs && b->tokens; i++) {
        fr_status st = fr_sampling_params_check(&b->rows[i].params, V);
        if (st) return st;
    }
    fr_status st = step_room(r, n_seqs, b->tokens != NULL);
    if (!st) st = fr_runner_cpu_step(r->cpu, b->seqs, n_seqs, r->logits);
    for (int i = 0; i < n_seqs && !st && b->tokens; i++)
        st = fr_sample(r->sampler, r->logits + (size_t)i * V, &b->rows[i].params, b->rows[i].sequence,
                       b->rows[i].step, &b->tokens[i], b->logprobs ? &b->logprobs[i] : NULL);
    if (!st) copy_kept(r, b->keep, b->n_keep, b->kept_logits);
    return st;
}

/* A step of any shape: the draws from their logit rows, the kept rows out. */
static fr_status step_draw(cpu_runner *r, const fr_batch *b)
{
    const int V = r->vocab;
    const int n_rows = fr_step_logit_rows(b->seqs, b->n_seqs);
    for (int i = 0; i < b->n_draws; i++) {
        const fr_step_draw *d = &b->draws[i];
        if (d->row < 0 || d->row >= n_rows)
            return fr_fail(FR_EINVAL, "step: draw %d reads logit row %d of %d", i, d->row, n_rows);
        fr_status st = fr_sampling_params_check(&d->d.params, V);
        if (st) return st;
    }
    for (int i = 0; i < b->n_keep; i++)
        if (b->keep[i] < 0 || b->keep[i] >= n_rows)
            return fr_fail(FR_EINVAL, "step: logit row %d to keep is outside the step's %d", b->keep[i], n_rows);
    fr_status st = step_room(r, n_rows, b->n_draws > 0);
    if (!st) st = fr_runner_cpu_step(r->cpu, b->seqs, b->n_seqs, r->logits);
    for (int i = 0; i < b->n_draws && !st; i++) {
        const fr_step_draw *d = &b->draws[i];
        st = fr_sample(r->sampler, r->logits + (size_t)d->row * V, &d->d.params, d->d.sequence, d->d.step,
                       &b->tokens[i], b->logprobs ? &b->logprobs[i] : NULL);
    }
    if (!st) copy_kept(r, b->keep, b->n_keep, b->kept_logits);
    return st;
}

static fr_status cpu_run(fr_runner *base, const fr_batch *b)
{
    cpu_runner *r = cpu_of(base);
    switch (b->kind) {
    case FR_BATCH_FILL:
        return fr_runner_cpu_fill(r->cpu, b->seqs, b->n_seqs);
    case FR_BATCH_STEP:
        return b->logits ? fr_runner_cpu_step(r->cpu, b->seqs, b->n_seqs, b->logits) : step_draw(r, b);
    case FR_BATCH_DECODE:
        if (b->phase == FR_RUN_WHOLE) return decode(r, b);
        /* Nothing runs beside a CPU step: it has ended when it returns. */
        if (b->rider) return fr_fail(FR_EUNSUPPORTED, "a decode carrying another session's needs the CUDA backend");
        return fr_fail(FR_EUNSUPPORTED, "a decode launched apart from its wait needs the CUDA backend");
    }
    return fr_fail(FR_EINVAL, "CPU runner: unknown batch kind %d", (int)b->kind);
}

static fr_status cpu_set_observer(fr_runner *base, const fr_forward_observer *obs)
{
    fr_runner_cpu_set_observer(cpu_of(base)->cpu, obs);
    return FR_OK;
}

static fr_status cpu_set_deterministic(fr_runner *base, int on)
{
    fr_runner_cpu_set_deterministic(cpu_of(base)->cpu, on);
    return FR_OK;
}

static fr_status cpu_weights_changed(fr_runner *base) { return fr_runner_cpu_weights_changed(cpu_of(base)->cpu); }

static fr_status cpu_capture_routes(fr_runner *base, int on)
{
    return fr_runner_cpu_capture_routes(cpu_of(base)->cpu, on);
}

static fr_status cpu_routes(fr_runner *base, const int *rows, int n, uint16_t *out)
{
    return fr_runner_cpu_routes(cpu_of(base)->cpu, rows, n, out);
}

static void cpu_destroy(fr_runner *base)
{
    cpu_runner *r = cpu_of(base);
    fr_runner_cpu_destroy(&r->cpu);
    fr_sampler_destroy(&r->sampler);
    free(r->logits);
    free(r);
}

/* No fork, key mean, capture statistics or memory op: the CPU cache is
 * the runner's own (fork and key mean are done there, the session releases
 * its pages) and nothing is captured. */
static const fr_runner_ops cpu_ops = {
    .run = cpu_run,
    .set_observer = cpu_set_observer,
    .set_deterministic = cpu_set_deterministic,
    .weights_changed = cpu_weights_changed,
    .capture_routes = cpu_capture_routes,
    .routes = cpu_routes,
    .destroy = cpu_destroy,
};

fr_status fr_runner_cpu_open(const fr_runner_config *c, fr_runner **out)
{
    fr_status st = fr_runner_backend_new("fr_runner_cpu_open", c, &cpu_ops, 0, sizeof(cpu_runner), out);
    if (st) return st;
    cpu_runner *r = cpu_of(*out);
    r->vocab = c->model->cfg.vocab_size;
    st = fr_runner_cpu_new_tp(c->model, c->kv, c->max_step_tokens, c->tp, &r->cpu);
    if (st) {
        free(r);
        *out = NULL;
        return st;
    }
    fr_runner_cpu_set_deterministic(r->cpu, c->deterministic);
    return FR_OK;
}
