/* Results (trainer_bridge/client/client.h): token deltas, dones and errors
 * about requests, handed to the reader they belong to (one that names the
 * request, or one that reads every request not owned by another), raw or
 * assembled into whole samples. */
#include "trainer_bridge/client/client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "trainer_bridge/protocol/wire.h"

/* ---- which result is next ------------------------------------------------------ */

/* The oldest result a reader may take: of the requests named, or (ids NULL)
 * of any request not owned by a reader. With strays, a reply no call waits
 * for counts too (the raw reader's). */
static item *next_result_locked(fr_client *c, const uint64_t *ids, int n, int strays, item **stray)
{
    item *best = NULL;
    if (ids) {
        for (int i = 0; i < n; i++) {
            req *q = fr_client_find_locked(c, ids[i]);
            if (q && q->first && (!best || q->first->seq < best->seq)) best = q->first;
        }
    } else {
        for (item *it = c->head; it && !best; it = it->next)
            if (!it->q || !it->q->owned) best = it;
    }
    *stray = NULL;
    if (strays && c->stray_head && (!best || c->stray_head->seq < best->seq)) {
        *stray = c->stray_head;
        c->stray_head = c->stray_head->next;
        if (!c->stray_head) c->stray_tail = NULL;
        (*stray)->next = NULL;
        return NULL;
    }
    return best ? fr_client_pop_locked(c, best->q, best) : NULL;
}

/* Nothing more can come for the reader: the connection is lost with its
 * samples still out. */
static fr_status lost_check_locked(fr_client *c, const uint64_t *ids, int n)
{
    if (fr_client_lost_locked(c, ids, n) > 0) return fr_client_lost_error_locked(c, ids, n);
    return FR_OK;
}

fr_status fr_client_next(fr_client *c, int timeout_ms, fr_msg *out, int *got)
{
    if (!c || !out || !got) return fr_fail(FR_EINVAL, "client: next needs out and got");
    *got = 0;
    pthread_mutex_lock(&c->mu);
    const double until = fr_client_until(timeout_ms);
    fr_status st = FR_OK;
    for (int first = 1; !st; first = 0) {
        item *stray, *it = next_result_locked(c, NULL, 0, 1, &stray);
        if (!it) it = stray;
        if (it) {
            *out = it->m;
            *got = 1;
            free(it);
            fr_client_delivered_locked(c, out);
            break;
        }
        if ((st = lost_check_locked(c, NULL, 0))) break;
        if (!first && timeout_ms >= 0 && fr_now_ms() >= until) break;
        st = fr_client_pump_locked(c, until);
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

fr_status fr_client_dispatch(fr_client *c, const fr_client_handlers *h, int timeout_ms, int *handled)
{
    if (handled) *handled = 0;
    if (!c || !h) return fr_fail(FR_EINVAL, "client: dispatch needs handlers");
    int wait = timeout_ms;
    for (;;) {
        fr_msg m;
        int got;
        fr_status st = fr_client_next(c, wait, &m, &got);
        if (st || !got) return st;
        wait = 0;   /* then everything already waiting, without blocking */
        if (m.type == FR_MSG_TOKENS && h->on_tokens) h->on_tokens(h->user, &m.u.tokens);
        else if (m.type == FR_MSG_DONE && h->on_done) h->on_done(h->user, &m.u.done);
        else if (m.type == FR_MSG_ERROR && h->on_error) h->on_error(h->user, &m.u.error);
        fr_msg_free(&m);
        if (handled) (*handled)++;
    }
}

/* ---- samples assembled from their deltas ------------------------------------------ */

void fr_client_sample_free(fr_client_sample **ps)
{
    if (!ps || !*ps) return;
    fr_client_sample *s = *ps;
    free(s->token_ids);
    free(s->logprobs);
    free(s->weight_versions);
    free(s->divergence.kl);
    free(s->top_token_ids);
    free(s->top_logprobs);
    free(s->prompt_logprobs);
    free(s->text);
    free(s->stop_str);
    free(s->prompt_token_ids);
    free(s->routed_experts);
    free(s);
    *ps = NULL;
}

/* The part of a sample; a new one starts at token `start` of the sample
 * (a continuation's tokens count from its continued ones: docs/protocol.md,
 * "tokens"). */
static partial *find_part(fr_client *c, uint64_t id, int sample, int start)
{
    for (int i = 0; i < c->n_parts; i++)
        if (c->parts[i].s->request_id == id && c->parts[i].s->sample == sample) return &c->parts[i];
    if (c->n_parts == c->cap_parts) {
        int cap = c->cap_parts ? c->cap_parts * 2 : 64;
        partial *v = realloc(c->parts, sizeof *v * (size_t)cap);
        if (!v) return NULL;
        c->parts = v;
        c->cap_parts = cap;
    }
    fr_client_sample *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->request_id = id;
    s->sample = sample;
    s->start = start;
    c->parts[c->n_parts] = (partial){.s = s, .cap = 0};
    return &c->parts[c->n_parts++];
}

static fr_status add_tokens(fr_client *c, const fr_msg_tokens *t)
{
    const req *q = fr_client_find_locked(c, t->request_id);
    partial *p = find_part(c, t->request_id, t->sample, q && q->g.continue_tokens ? q->g.n_continue_tokens : 0);
    if (!p) return fr_fail(FR_ENOMEM, "client: out of memory keeping a sample");
    fr_client_sample *s = p->s;
    if (t->start != s->start + s->n_tokens)
        return fr_fail(FR_EFORMAT, "client: request %llu sample %d: a delta starts at token %d after %d tokens",
                       (unsigned long long)t->request_id, t->sample, t->start, s->start + s->n_tokens);
    if (s->n_tokens + t->n > p->cap) {
        int cap = p->cap ? p->cap : 64;
        while (cap < s->n_tokens + t->n) cap *= 2;
        int *a = realloc(s->token_ids, sizeof(int) * (size_t)cap);
        if (a) s->token_ids = a;
        float *l = a ? realloc(s->logprobs, sizeof(float) * (size_t)cap) : NULL;
        if (l) s->logprobs = l;
        uint64_t *v = l ? realloc(s->weight_versions, sizeof(uint64_t) * (size_t)cap) : NULL;
        if (v) s->weight_versions = v;
        if (!v) return fr_fail(FR_ENOMEM, "client: out of memory keeping a sample");
        p->cap = cap;
    }
    memcpy(s->token_ids + s->n_tokens, t->token_ids, sizeof(int) * (size_t)t->n);
    memcpy(s->logprobs + s->n_tokens, t->logprobs, sizeof(float) * (size_t)t->n);
    memcpy(s->weight_versions + s->n_tokens, t->weight_versions, sizeof(uint64_t) * (size_t)t->n);
    s->n_tokens += t->n;
    return FR_OK;
}

/* The finished sample of a done (taken out of the partial list; the done's
 * arrays move into it). */
static fr_status finish_sample(fr_client *c, fr_msg_done *d, fr_client_sample **out)
{
    partial *p = find_part(c, d->request_id, d->sample, d->start);   /* no delta came: it starts where the done says */
    if (!p) return fr_fail(FR_ENOMEM, "client: out of memory keeping a sample");
    fr_client_sample *s = p->s;
    *p = c->parts[--c->n_parts];
    if (s->n_tokens != d->n_tokens || s->start != d->start) {
        fr_status st = fr_fail(FR_EFORMAT, "client: request %llu sample %d: %d tokens streamed from token %d, the "
                                           "done says %d from token %d",
                               (unsigned long long)d->request_id, d->sample, s->n_tokens, s->start, d->n_tokens,
                               d->start);
        fr_client_sample_free(&s);
        return st;
    }
    s->group_id = d->group_id;
    snprintf(s->finish_reason, sizeof s->finish_reason, "%s", fr_wire_finish_name(d->finish_reason));
    s->n_prompt = d->n_prompt;
    s->preemptions = d->preemptions;
    s->has_ttft = d->has_ttft;
    s->ttft_ms = d->ttft_ms;
    s->total_ms = d->total_ms;
    s->divergence = d->divergence;
    s->has_seed = d->has_seed;
    s->seed = d->seed;
    s->top_k = d->top_k;
    s->top_token_ids = d->top_token_ids;
    s->top_logprobs = d->top_logprobs;
    s->prompt_logprobs = d->prompt_logprobs;
    s->n_prompt_logprobs = d->n_prompt_logprobs;
    s->has_text = d->has_text;
    s->text = d->text;
    s->text_len = d->text_len;
    s->stop_str = d->stop_str;
    s->prompt_token_ids = d->prompt_token_ids;
    s->n_prompt_token_ids = d->n_prompt_token_ids;
    s->routed_experts = d->routed_experts;
    s->route_layers = d->route_layers;
    s->route_k = d->route_k;
    s->route_width = d->route_width;
    d->routed_experts = NULL;
    d->divergence.kl = NULL;
    d->divergence.n_kl = 0;
    d->top_token_ids = NULL;
    d->top_logprobs = NULL;
    d->prompt_logprobs = NULL;
    d->text = NULL;
    d->stop_str = NULL;
    d->prompt_token_ids = NULL;
    *out = s;
    return FR_OK;
}

void fr_client_event_free(fr_client_event *ev)
{
    if (!ev) return;
    fr_client_sample_free(&ev->sample);
    if (ev->msg_) {
        fr_msg_free((fr_msg *)ev->msg_);
        free(ev->msg_);
    }
    memset(ev, 0, sizeof *ev);
}

/* The event of one result (mu held): a delta (handed out when deltas is
 * set, else only assembled: *ev stays NONE), a finished sample, or an error
 * about a request. Takes the message. */
static fr_status event_of(fr_client *c, fr_msg *m, int deltas, fr_client_event *ev)
{
    fr_status st = FR_OK;
    if (m->type == FR_MSG_TOKENS) {
        const fr_msg_tokens *t = &m->u.tokens;
        st = add_tokens(c, t);
        fr_msg *keep = !st && deltas ? malloc(sizeof *keep) : NULL;
        if (keep) {
            *keep = *m;
            ev->msg_ = keep;
            ev->kind = FR_CLIENT_EVENT_DELTA;
            ev->request_id = t->request_id;
            ev->delta = (fr_client_delta){.request_id = t->request_id, .sample = t->sample, .start = t->start,
                                          .n = t->n, .token_ids = keep->u.tokens.token_ids,
                                          .logprobs = keep->u.tokens.logprobs,
                                          .weight_versions = keep->u.tokens.weight_versions,
                                          .has_text = keep->u.tokens.has_text,
                                          .text = keep->u.tokens.text ? keep->u.tokens.text : "",
                                          .text_len = keep->u.tokens.text_len};
            return FR_OK;
        }
        if (!st && deltas) st = fr_fail(FR_ENOMEM, "client: out of memory handing out a delta");
    } else if (m->type == FR_MSG_DONE) {
        if (!(st = finish_sample(c, &m->u.done, &ev->sample))) {
            ev->kind = FR_CLIENT_EVENT_SAMPLE;
            ev->request_id = m->u.done.request_id;
        }
    } else if (m->type == FR_MSG_ERROR) {
        (void)fr_client_server_error_(&m->u.error, "server error about a request");
        ev->kind = FR_CLIENT_EVENT_ERROR;
        ev->request_id = m->u.error.request_id;
        snprintf(ev->code, sizeof ev->code, "%s", m->u.error.code);
        snprintf(ev->message, sizeof ev->message, "%s", m->u.error.message);
    }
    fr_msg_free(m);
    return st;
}

fr_status fr_client_wait_event(fr_client *c, const uint64_t *ids, int n, int deltas, int timeout_ms,
                               fr_client_event *ev)
{
    if (ev) memset(ev, 0, sizeof *ev);
    if (!c || !ev || n < 0 || (n > 0 && !ids)) return fr_fail(FR_EINVAL, "client: wait_event needs ev (and ids)");
    if (n == 0) ids = NULL;
    pthread_mutex_lock(&c->mu);
    const double until = fr_client_until(timeout_ms);
    fr_status st = FR_OK;
    for (int first = 1; !st && ev->kind == FR_CLIENT_EVENT_NONE; first = 0) {
        item *stray, *it = next_result_locked(c, ids, n, 0, &stray);
        if (it) {
            fr_msg m = it->m;
            free(it);
            fr_client_delivered_locked(c, &m);
            st = event_of(c, &m, deltas, ev);
            first = 1;   /* a delta only assembled: look again before waiting */
            continue;
        }
        if ((st = lost_check_locked(c, ids, n))) break;
        if (fr_client_open_locked(c, ids, n) == 0) break;   /* nothing more will come */
        if (!first && timeout_ms >= 0 && fr_now_ms() >= until) break;
        st = fr_client_pump_locked(c, until);
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* The legacy readers of every request not owned: an error about a request
 * fails the call, and a delta's arrays live until the client's next call. */
static fr_status next_any(fr_client *c, int timeout_ms, fr_client_delta *delta, fr_client_sample **out, int *got)
{
    *out = NULL;
    *got = 0;
    fr_client_event ev;
    fr_status st = fr_client_wait_event(c, NULL, 0, delta != NULL, timeout_ms, &ev);
    if (st) return st;
    pthread_mutex_lock(&c->mu);
    fr_msg_free(&c->delta);   /* the arrays of the delta handed out last */
    if (ev.kind == FR_CLIENT_EVENT_DELTA) {
        c->delta = *(fr_msg *)ev.msg_;
        free(ev.msg_);
        ev.msg_ = NULL;
        *delta = ev.delta;
        *got = 1;
    }
    pthread_mutex_unlock(&c->mu);
    if (ev.kind == FR_CLIENT_EVENT_SAMPLE) {
        *out = ev.sample;
        ev.sample = NULL;
        *got = 2;
    } else if (ev.kind == FR_CLIENT_EVENT_ERROR) {
        st = fr_fail(FR_EINVAL, "server error about a request: %s: %s", ev.code, ev.message);
    }
    fr_client_event_free(&ev);
    return st;
}

fr_status fr_client_next_sample(fr_client *c, int timeout_ms, fr_client_sample **out, int *got)
{
    if (!c || !out || !got) return fr_fail(FR_EINVAL, "client: next_sample needs out and got");
    fr_status st = next_any(c, timeout_ms, NULL, out, got);
    *got = *got != 0;
    return st;
}

fr_status fr_client_next_event(fr_client *c, int timeout_ms, fr_client_delta *delta, fr_client_sample **out,
                               int *got)
{
    if (!c || !delta || !out || !got) return fr_fail(FR_EINVAL, "client: next_event needs delta, out and got");
    return next_any(c, timeout_ms, delta, out, got);
}
