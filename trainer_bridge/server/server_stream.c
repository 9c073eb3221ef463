/* The request table, and what goes out to clients: replies, deferred
 * replies, token deltas and the one done of every sample (docs/protocol.md). */
#include "trainer_bridge/server/server_internal.h"

static int find_index(const fr_bridge_server *srv, uint64_t sid)
{
    int lo = 0, hi = srv->n_reqs - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        uint64_t v = srv->reqs[mid]->sid;
        if (v == sid) return mid;
        if (v < sid) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

request *srv_find_sid(const fr_bridge_server *srv, uint64_t sid)
{
    int i = find_index(srv, sid);
    return i < 0 ? NULL : srv->reqs[i];
}

/* The sender's open request with its own id, or NULL. */
request *srv_find_caller(const fr_bridge_server *srv, int peer, uint64_t request_id)
{
    for (int i = 0; i < srv->n_reqs; i++)
        if (srv->reqs[i]->peer == peer && srv->reqs[i]->request_id == request_id) return srv->reqs[i];
    return NULL;
}

void srv_free_request(request *q)
{
    if (!q) return;
    for (int k = 0; q->s && k < q->n; k++) {
        free(q->s[k].tok);
        free(q->s[k].lp);
        free(q->s[k].wv);
    }
    srv_text_free(q);
    free(q->s);
    free((void *)q->spec.prompt);
    free((void *)q->spec.stop_ids);
    free((void *)q->spec.forced);
    free((void *)q->spec.continue_tokens);
    free(q);
}

void srv_remove_request(fr_bridge_server *srv, request *q)
{
    int i = find_index(srv, q->sid);
    if (i >= 0) {
        memmove(&srv->reqs[i], &srv->reqs[i + 1], sizeof(request *) * (size_t)(srv->n_reqs - i - 1));
        srv->n_reqs--;
    }
    srv_free_request(q);
}

/* ---- sending ------------------------------------------------------------- */

/* Encodes and queues m for the peer. A message that cannot be encoded or
 * queued is reported in the log (it is a bug or out of memory). */
void srv_send_msg(fr_bridge_server *srv, int peer, const fr_msg *m)
{
    const int local = srv_local_client_of(srv, peer);
    if (local >= 0) {   /* an in-process client: the message itself, no encoding */
        srv_local_deliver(srv, local, m);
        srv->messages_out++;
        return;
    }
    char *data;
    size_t len;
    fr_status st = fr_msg_encode(m, &data, &len);
    if (st) {
        srv_log(srv, "cannot encode a %s message for client %s: %s", fr_msg_type_name(m->type),
              fr_peers_name(srv->peers, peer), fr_last_error());
        return;
    }
    if (fr_peers_send(srv->peers, peer, data, len)) {
        srv_log(srv, "sending to client %s: %s", fr_peers_name(srv->peers, peer), fr_last_error());
        return;
    }
    srv->messages_out++;
}

/* A reply that must follow the done messages of what it ended: sent at
 * once with one process; with several ranks those dones arrive at the end
 * of the turn, so the reply waits for them. */
void srv_send_later(fr_bridge_server *srv, int peer, const fr_msg *m)
{
    if (!srv->multi) {
        srv_send_msg(srv, peer, m);
        return;
    }
    char *data;
    size_t len;
    if (fr_msg_encode(m, &data, &len)) {
        srv_log(srv, "cannot encode a %s message for client %s: %s", fr_msg_type_name(m->type),
              fr_peers_name(srv->peers, peer), fr_last_error());
        return;
    }
    if (srv->n_deferred == srv->cap_deferred) {
        int c = srv->cap_deferred ? srv->cap_deferred * 2 : 8;
        deferred_msg *v = realloc(srv->deferred, sizeof *v * (size_t)c);
        if (!v) {
            free(data);
            srv_log(srv, "out of memory keeping a reply for client %s", fr_peers_name(srv->peers, peer));
            return;
        }
        srv->deferred = v;
        srv->cap_deferred = c;
    }
    srv->deferred[srv->n_deferred++] = (deferred_msg){.peer = peer, .data = data, .len = len};
}

void srv_send_deferred(fr_bridge_server *srv)
{
    for (int i = 0; i < srv->n_deferred; i++) {
        deferred_msg *d = &srv->deferred[i];
        const int local = srv_local_client_of(srv, d->peer);
        if (local >= 0) {
            fr_msg m;
            if (!fr_msg_decode(d->data, d->len, &m)) {
                srv_local_deliver(srv, local, &m);
                fr_msg_free(&m);
                srv->messages_out++;
            }
            free(d->data);
            continue;
        }
        if (fr_peers_send(srv->peers, d->peer, d->data, d->len))
            srv_log(srv, "sending to client %s: %s", fr_peers_name(srv->peers, d->peer), fr_last_error());
        else srv->messages_out++;
    }
    srv->n_deferred = 0;
}

void srv_send_error(fr_bridge_server *srv, int peer, const char *code, int has_id, uint64_t id,
                    const char *fmt, ...)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_ERROR);
    snprintf(m.u.error.code, sizeof m.u.error.code, "%s", code);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m.u.error.message, sizeof m.u.error.message, fmt, ap);
    va_end(ap);
    m.u.error.has_request_id = has_id;
    m.u.error.request_id = id;
    srv->errors_sent++;
    srv_send_msg(srv, peer, &m);
}

/* Sends sample k's pending tokens as one delta. */
static void flush_sample(fr_bridge_server *srv, request *q, int k)
{
    sample_state *s = &q->s[k];
    if (s->n_pending == 0) return;
    fr_msg m;
    fr_msg_init(&m, FR_MSG_TOKENS);
    m.u.tokens = (fr_msg_tokens){.request_id = q->request_id, .sample = q->first_sample + k,
                                 .start = q->start + s->sent, .n = s->n_pending,
                                 .token_ids = s->tok, .logprobs = s->lp, .weight_versions = s->wv};
    srv_text_delta(q, s, &m.u.tokens);
    srv_send_msg(srv, q->peer, &m);
    srv->tokens_streamed += (uint64_t)s->n_pending;
    s->sent += s->n_pending;
    s->n_pending = 0;
}

void srv_flush_all(fr_bridge_server *srv)
{
    for (int i = 0; i < srv->n_reqs; i++)
        for (int k = 0; k < srv->reqs[i]->n; k++) flush_sample(srv, srv->reqs[i], k);
}

/* Sends sample k's done and closes it; frees the request with its last
 * sample (q must not be used after). div: the divergence figures, NULL for
 * none. */
void srv_send_done(fr_bridge_server *srv, request *q, int k, fr_wire_finish why, int n_tokens, int preemptions,
                   const fr_msg_divergence *div, const fr_sample_result *res)
{
    flush_sample(srv, q, k);
    sample_state *s = &q->s[k];
    if (n_tokens != s->sent)
        srv_log(srv, "request %llu sample %d: %d tokens streamed, the engine reports %d",
              (unsigned long long)q->request_id, k, s->sent, n_tokens);
    fr_msg m;
    fr_msg_init(&m, FR_MSG_DONE);
    double t = fr_now_ms();
    m.u.done = (fr_msg_done){.request_id = q->request_id, .group_id = q->group_id, .sample = q->first_sample + k,
                             .finish_reason = why, .start = q->start, .n_tokens = s->sent, .n_prompt = q->n_prompt,
                             .preemptions = preemptions, .has_ttft = s->has_first,
                             .ttft_ms = s->has_first ? s->first_ms - q->t0_ms : 0, .total_ms = t - q->t0_ms,
                             .has_seed = 1, .seed = q->seed};
    if (div) m.u.done.divergence = *div;
    if (res && res->top_n > 0 && res->top_ids && res->n_tokens == s->sent) {
        m.u.done.top_k = res->top_n;
        m.u.done.top_token_ids = res->top_ids;
        m.u.done.top_logprobs = res->top_logprobs;
    }
    if (res && res->prompt_logprobs && res->n_prompt_logprobs == q->n_prompt - 1) {
        m.u.done.prompt_logprobs = res->prompt_logprobs;
        m.u.done.n_prompt_logprobs = res->n_prompt_logprobs;
    }
    if (res && res->routed_experts && res->n_tokens == s->sent) {
        m.u.done.routed_experts = res->routed_experts;
        m.u.done.route_layers = res->route_layers;
        m.u.done.route_k = res->route_k;
        m.u.done.route_width = res->route_width;
    }
    srv_text_done(q, s, res, &m.u.done);
    srv_send_msg(srv, q->peer, &m);
    srv->samples_done++;
    s->ended = 1;
    if (--q->open == 0) srv_remove_request(srv, q);
}

/* Ends every open sample on the coordinator's side alone (the engines may
 * be gone: a lost rank), each with its tokens streamed so far; returns how
 * many. */
int srv_end_all(fr_bridge_server *srv, fr_wire_finish why)
{
    int n_sids, ended = 0;
    uint64_t *sids = srv_sids_of(srv, -1, &n_sids);
    for (int i = 0; sids && i < n_sids; i++) {
        request *q = srv_find_sid(srv, sids[i]);
        for (int k = 0; q && k < q->n; k++) {
            if (q->s[k].ended) continue;
            const int last = q->open == 1;
            srv_send_done(srv, q, k, why, q->s[k].sent + q->s[k].n_pending, 0, NULL, NULL);
            ended++;
            if (last) break;   /* q is freed */
        }
    }
    free(sids);
    return ended;
}

/* ---- scheduler callbacks -------------------------------------------------- */

/* A token drawn by an engine with weight version `version`, kept for the
 * next delta. */
void srv_token_in(fr_bridge_server *srv, uint64_t sid, int sample, int index, int token, float logprob,
                  uint64_t version)
{
    request *q = srv_find_sid(srv, sid);
    if (!q || sample < q->first_sample || sample - q->first_sample >= q->n) return;
    sample_state *s = &q->s[sample - q->first_sample];
    if (index != q->start + s->sent + s->n_pending)   /* the engine counts a continuation's tokens from its start */
        srv_log(srv, "request %llu sample %d: token %d arrived out of order (expected %d)",
              (unsigned long long)q->request_id, sample, index, q->start + s->sent + s->n_pending);
    if (s->n_pending == s->cap) {
        int c = s->cap ? s->cap * 2 : 16;
        int *t = realloc(s->tok, sizeof(int) * (size_t)c);
        if (t) s->tok = t;
        float *l = t ? realloc(s->lp, sizeof(float) * (size_t)c) : NULL;
        if (l) s->lp = l;
        uint64_t *v = l ? realloc(s->wv, sizeof(uint64_t) * (size_t)c) : NULL;
        if (v) s->wv = v;
        if (!t || !l || !v) {
            srv_log(srv, "out of memory keeping a token of request %llu", (unsigned long long)q->request_id);
            return;
        }
        s->cap = c;
    }
    if (!s->has_first) {
        s->has_first = 1;
        s->first_ms = fr_now_ms();
    }
    s->tok[s->n_pending] = token;
    s->wv[s->n_pending] = version;
    s->lp[s->n_pending++] = logprob;
}

void srv_on_token(void *user, uint64_t sid, int sample, int index, int token, float logprob)
{
    fr_bridge_server *srv = user;
    /* Weights change only between steps, and the scheduler stamps a token
     * with the version it was told last: the server's (this rank's). */
    if (!srv->multi) {
        srv_token_in(srv, sid, sample, index, token, logprob, srv->weight_version);
    } else if (srv->leader) {
        fr_rank_put_u8(&srv->outbox, OB_TOKEN);
        fr_rank_put_u64(&srv->outbox, sid);
        fr_rank_put_i32(&srv->outbox, sample);
        fr_rank_put_i32(&srv->outbox, index);
        fr_rank_put_i32(&srv->outbox, token);
        fr_rank_put_f32(&srv->outbox, logprob);
        fr_rank_put_u64(&srv->outbox, srv->weight_version);
    }
}

fr_wire_finish srv_wire_finish(fr_finish_reason r)
{
    switch (r) {
    case FR_FINISH_STOP: return FR_WIRE_STOP;
    case FR_FINISH_LENGTH: return FR_WIRE_LENGTH;
    case FR_FINISH_ABORT: return FR_WIRE_ABORT;
    default: return FR_WIRE_ERROR;
    }
}

/* The divergence figures of a result (none when it was not monitored). */
void srv_divergence_of(const fr_sample_result *r, fr_msg_divergence *div)
{
    memset(div, 0, sizeof *div);
    if (r->monitored && r->div.n > 0) {
        div->has_values = 1;
        div->kl_mean = r->div.kl_sum / (double)r->div.n;
        div->kl_max = r->div.kl_max;
        div->top1_agreement = (double)r->div.top1_agree / (double)r->div.n;
        div->logprob_diff_mean = r->div.logp_diff_sum / (double)r->div.n;
        div->positions = (int)r->div.n;
        if (r->kl && r->n_tokens > 0) {
            div->kl = r->kl;
            div->n_kl = r->n_tokens;
        }
    }
}

/* Several ranks: an engine leader's record of a finished sample (its tokens
 * went out one by one as OB_TOKEN records). */
static void put_done(fr_bridge_server *srv, const fr_sample_result *r)
{
    fr_rank_put_u8(&srv->outbox, OB_DONE);
    fr_sample_result_put(&srv->outbox, r, 0);
}

void srv_on_done(void *user, const fr_sample_result *r)
{
    fr_bridge_server *srv = user;
    if (srv->multi) {
        if (srv->leader) put_done(srv, r);
        return;
    }
    request *q = srv_find_sid(srv, r->request_id);
    const int k = q ? r->sample - q->first_sample : -1;
    if (!q || k < 0 || k >= q->n) {
        srv_log(srv, "the engine ended an unknown sample (%llu, %d)", (unsigned long long)r->request_id, r->sample);
        return;
    }
    /* The tokens were stamped as they were drawn; the result's versions say
     * the same (a mismatch would be a bug worth a log line). */
    const sample_state *s = &q->s[k];
    for (int i = 0; r->versions && i < s->n_pending; i++) {
        int idx = s->sent + i;
        if (idx < r->n_tokens && r->versions[idx] != s->wv[i]) {
            srv_log(srv, "request %llu sample %d token %d: streamed with weight version %llu, the engine says %llu",
                  (unsigned long long)q->request_id, r->sample, idx, (unsigned long long)s->wv[i],
                  (unsigned long long)r->versions[idx]);
            break;
        }
    }
    fr_msg_divergence div;
    srv_divergence_of(r, &div);
    srv_send_done(srv, q, k, srv_wire_finish(r->finish), r->n_tokens, r->preemptions, &div, r);
}
