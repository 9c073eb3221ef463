/* The C client's requests (trainer_bridge/client/client.h): the table of
 * what was sent and not yet handed out, sending and resending, giving up,
 * and the counts of what is open. */
#include "trainer_bridge/client/client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- requests as sent ------------------------------------------------------ */

static int *copy_ints(const int *v, int n)
{
    if (!v) return NULL;
    int *c = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (c && n > 0) memcpy(c, v, sizeof(int) * (size_t)n);
    return c;
}

void fr_client_free_generate(fr_msg_generate *g)
{
    free(g->prompt);
    free(g->stop_token_ids);
    free(g->forced_tokens);
    free(g->continue_tokens);
    free(g->prompt_text);
    for (int i = 0; g->stop && i < g->n_stop; i++) free(g->stop[i]);
    free(g->stop);
    memset(g, 0, sizeof *g);
}

/* The text keys' copies: 0, or -1 when out of memory (what was copied stays for the free). */
int fr_client_copy_generate_text(const fr_msg_generate *g, fr_msg_generate *out)
{
    out->prompt_text = NULL;
    out->stop = NULL;
    if (g->prompt_text) {
        if (!(out->prompt_text = malloc(g->prompt_text_len + 1))) return -1;
        memcpy(out->prompt_text, g->prompt_text, g->prompt_text_len);
        out->prompt_text[g->prompt_text_len] = '\0';
    }
    if (g->stop && !(out->stop = calloc((size_t)(g->n_stop > 0 ? g->n_stop : 1), sizeof *out->stop))) return -1;
    for (int i = 0; g->stop && i < g->n_stop; i++)
        if (g->stop[i] && !(out->stop[i] = strdup(g->stop[i]))) return -1;
    return 0;
}

static int copy_generate(const fr_msg_generate *g, fr_msg_generate *out)
{
    *out = *g;
    out->prompt = copy_ints(g->prompt, g->n_prompt);
    out->stop_token_ids = copy_ints(g->stop_token_ids, g->n_stop_token_ids);
    out->forced_tokens = copy_ints(g->forced_tokens, g->n_forced_tokens);
    out->continue_tokens = copy_ints(g->continue_tokens, g->n_continue_tokens);
    const int text_failed = fr_client_copy_generate_text(g, out);
    if ((g->prompt && !out->prompt) || (g->stop_token_ids && !out->stop_token_ids) ||
        (g->forced_tokens && !out->forced_tokens) || (g->continue_tokens && !out->continue_tokens) || text_failed) {
        fr_client_free_generate(out);
        return -1;
    }
    return 0;
}

/* ---- the request table ------------------------------------------------------ */

/* Requests by id: every result and every reader's wait looks requests up,
 * and a rollout batch holds thousands open at once, so a scan of the table
 * per lookup made reading results quadratic (bench/RESULTS.md, "HTTP API
 * against ZeroMQ"). Linear probing; a removal shifts the run after it back
 * (no tombstones). */
static size_t id_slot(uint64_t id, int cap)
{
    id ^= id >> 33;
    id *= 0xff51afd7ed558ccdull;
    id ^= id >> 33;
    return (size_t)id & (size_t)(cap - 1);
}

static void index_put(req **t, int cap, req *q)
{
    size_t i = id_slot(q->id, cap);
    while (t[i]) i = (i + 1) & (size_t)(cap - 1);
    t[i] = q;
}

/* Room for one more request in the index (at most half full); -1 when out of memory. */
static int index_reserve(fr_client *c)
{
    if (2 * (c->n_reqs + 1) <= c->cap_by_id) return 0;
    int cap = c->cap_by_id ? 2 * c->cap_by_id : 128;
    req **t = calloc((size_t)cap, sizeof *t);
    if (!t) return -1;
    for (int i = 0; i < c->n_reqs; i++) index_put(t, cap, c->reqs[i]);
    free(c->by_id);
    c->by_id = t;
    c->cap_by_id = cap;
    return 0;
}

static void index_remove(fr_client *c, const req *q)
{
    const size_t mask = (size_t)c->cap_by_id - 1;
    size_t i = id_slot(q->id, c->cap_by_id);
    while (c->by_id[i] != q) i = (i + 1) & mask;
    c->by_id[i] = NULL;
    for (size_t j = (i + 1) & mask; c->by_id[j]; j = (j + 1) & mask) {
        req *r = c->by_id[j];
        const size_t home = id_slot(r->id, c->cap_by_id);
        /* r stays unless the emptied slot i lies on its way from home to j */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            c->by_id[i] = r;
            c->by_id[j] = NULL;
            i = j;
        }
    }
}

req *fr_client_find_locked(const fr_client *c, uint64_t id)
{
    if (!c->cap_by_id) return NULL;
    for (size_t i = id_slot(id, c->cap_by_id); c->by_id[i]; i = (i + 1) & (size_t)(c->cap_by_id - 1))
        if (c->by_id[i]->id == id) return c->by_id[i];
    return NULL;
}

void fr_client_remove_req_locked(fr_client *c, req *q)
{
    for (int i = 0; i < c->n_reqs; i++)
        if (c->reqs[i] == q) {
            index_remove(c, q);
            c->reqs[i] = c->reqs[--c->n_reqs];
            break;
        }
    for (item *it = q->first; it; it = it->rnext) it->q = NULL;   /* (none left in the normal course) */
    fr_client_free_generate(&q->g);
    free(q);
}

/* Leaves the table once nothing of it is left to hand out (or, given up,
 * once nothing of it is left to arrive). */
void fr_client_settle_req_locked(fr_client *c, req *q)
{
    if (q->discarded ? q->unreceived <= 0 && !q->first : q->undelivered <= 0 && !q->first)
        fr_client_remove_req_locked(c, q);
}

int fr_client_closes_request(const fr_msg *m)
{
    return m->type == FR_MSG_ERROR && m->u.error.has_request_id &&
           strcmp(m->u.error.code, "duplicate_request_id") != 0;
}

uint64_t fr_client_result_id(const fr_msg *m)
{
    return m->type == FR_MSG_TOKENS ? m->u.tokens.request_id
           : m->type == FR_MSG_DONE ? m->u.done.request_id
                                    : m->u.error.request_id;
}

void fr_client_delivered_locked(fr_client *c, const fr_msg *m)
{
    if (m->type != FR_MSG_DONE && !fr_client_closes_request(m)) return;
    req *q = fr_client_find_locked(c, fr_client_result_id(m));
    if (!q) return;
    if (m->type == FR_MSG_DONE) q->undelivered--;
    else q->undelivered = 0;   /* a refused request: no done will come */
    fr_client_settle_req_locked(c, q);
}

item *fr_client_pop_locked(fr_client *c, req *q, item *it)
{
    if (it->prev) it->prev->next = it->next;
    else c->head = it->next;
    if (it->next) it->next->prev = it->prev;
    else c->tail = it->prev;
    if (q) {   /* a request's results are taken in order: it is the first */
        q->first = it->rnext;
        if (!q->first) q->last = NULL;
    }
    it->prev = it->next = it->rnext = NULL;
    return it;
}

/* The requests a reader counts, each once: those it names, looked up by id
 * (a reader may name a whole batch, and a scan of the table per name made
 * every wait quadratic); with ids NULL every one not owned; with ids but n
 * 0 every one. Discarded requests never count. mu held. */
typedef struct {
    const fr_client *c;
    const uint64_t *ids;   /* NULL: walk the table */
    int n, i, all;
    unsigned long gen;
} reader_walk;

static reader_walk walk_reader(const fr_client *c, const uint64_t *ids, int n)
{
    return (reader_walk){.c = c, .ids = n > 0 ? ids : NULL, .n = n, .all = ids != NULL,
                         .gen = ++((fr_client *)c)->count_gen};
}

static req *next_of_reader(reader_walk *w)
{
    if (w->ids) {
        while (w->i < w->n) {
            req *q = fr_client_find_locked(w->c, w->ids[w->i++]);
            if (q && !q->discarded && q->counted != w->gen) {
                q->counted = w->gen;   /* a name given twice counts once */
                return q;
            }
        }
        return NULL;
    }
    while (w->i < w->c->n_reqs) {
        req *q = w->c->reqs[w->i++];
        if (!q->discarded && (w->all || !q->owned)) return q;
    }
    return NULL;
}

int fr_client_lost_locked(const fr_client *c, const uint64_t *ids, int n)
{
    int k = 0;
    reader_walk w = walk_reader(c, ids, n);
    for (const req *q; (q = next_of_reader(&w));)
        if (q->lost && q->unreceived > 0) k += q->unreceived;
    return k;
}

fr_status fr_client_lost_error_locked(fr_client *c, const uint64_t *ids, int n)
{
    char list[600] = "";
    size_t o = 0;
    int listed = 0;
    reader_walk w = walk_reader(c, ids, n);
    for (const req *q; (q = next_of_reader(&w));) {
        if (!q->lost || q->unreceived <= 0) continue;
        if (o + 64 < sizeof list)
            o += (size_t)snprintf(list + o, sizeof list - o, "%s request %llu (%d of %d samples)", listed ? "," : "",
                                  (unsigned long long)q->id, q->unreceived, q->g.n);
        else if (o + 6 < sizeof list) o += (size_t)snprintf(list + o, sizeof list - o, ", ...");
        listed++;
    }
    return fr_fail(FR_EIO, "client: the connection to %s was lost (the server ended, or was silent for %d ms): "
                           "%d samples will not end:%s; fr_client_resubmit sends these requests again",
                   c->endpoint, FR_CLIENT_HEARTBEAT_TIMEOUT_MS, fr_client_lost_locked(c, ids, n), list);
}

/* ---- requests -------------------------------------------------------------------- */

static fr_status add_request_locked(fr_client *c, const fr_msg_generate *g, int owned)
{
    if (fr_client_find_locked(c, g->request_id))
        return fr_fail(FR_EINVAL, "client: request_id %llu is still open", (unsigned long long)g->request_id);
    if (c->n_reqs == c->cap_reqs) {
        int cap = c->cap_reqs ? c->cap_reqs * 2 : 64;
        req **v = realloc(c->reqs, sizeof *v * (size_t)cap);
        if (!v) return fr_fail(FR_ENOMEM, "client: out of memory");
        c->reqs = v;
        c->cap_reqs = cap;
    }
    if (index_reserve(c)) return fr_fail(FR_ENOMEM, "client: out of memory");
    req *q = calloc(1, sizeof *q);
    if (!q || copy_generate(g, &q->g)) {
        free(q);
        return fr_fail(FR_ENOMEM, "client: out of memory");
    }
    q->id = g->request_id;
    q->unreceived = q->undelivered = g->n;
    q->owned = owned;
    fr_msg m;
    fr_msg_init(&m, FR_MSG_GENERATE);
    m.u.generate = *g;
    fr_status st = fr_client_send_locked(c, &m, NULL);
    if (st) {
        fr_client_free_generate(&q->g);
        free(q);
        return st;
    }
    c->reqs[c->n_reqs++] = q;
    index_put(c->by_id, c->cap_by_id, q);
    return FR_OK;
}

static fr_status generate(fr_client *c, const fr_msg_generate *g, int owned)
{
    if (!c || !g) return fr_fail(FR_EINVAL, "client: NULL");
    pthread_mutex_lock(&c->mu);
    fr_status st = add_request_locked(c, g, owned);
    pthread_mutex_unlock(&c->mu);
    return st;
}

fr_status fr_client_generate(fr_client *c, const fr_msg_generate *g) { return generate(c, g, 0); }
fr_status fr_client_generate_owned(fr_client *c, const fr_msg_generate *g) { return generate(c, g, 1); }

void fr_client_drop_parts_locked(fr_client *c, uint64_t id)
{
    for (int k = 0; k < c->n_parts;)
        if (c->parts[k].s->request_id == id) {
            fr_client_sample_free(&c->parts[k].s);
            c->parts[k] = c->parts[--c->n_parts];
        } else {
            k++;
        }
}

/* Drops the request's results not yet taken. */
static void drop_results_locked(fr_client *c, req *q)
{
    while (q->first) {
        item *it = fr_client_pop_locked(c, q, q->first);
        fr_msg_free(&it->m);
        free(it);
    }
    fr_client_drop_parts_locked(c, q->id);
}

fr_status fr_client_resubmit(fr_client *c, int *n_requests)
{
    if (n_requests) *n_requests = 0;
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    pthread_mutex_lock(&c->mu);
    fr_client_sock_take_locked(c);
    fr_client_read_monitor_locked(c);
    fr_client_sock_give_locked(c);
    fr_status st = FR_OK;
    for (int i = 0; !st && i < c->n_reqs; i++) {
        req *q = c->reqs[i];
        if (!q->lost || q->unreceived <= 0 || q->discarded) continue;   /* alive, or nothing more to ask */
        /* the server starts every sample again: what came of them goes */
        drop_results_locked(c, q);
        fr_msg m;
        fr_msg_init(&m, FR_MSG_GENERATE);
        m.u.generate = q->g;
        if ((st = fr_client_send_locked(c, &m, NULL))) break;
        q->unreceived = q->undelivered = q->g.n;
        q->lost = 0;
        if (n_requests) (*n_requests)++;
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

fr_status fr_client_discard(fr_client *c, const uint64_t *ids, int n)
{
    if (!c || n < 0 || (n > 0 && !ids)) return fr_fail(FR_EINVAL, "client: discard needs ids");
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < n; i++) {
        req *q = fr_client_find_locked(c, ids[i]);
        if (!q) continue;
        drop_results_locked(c, q);
        q->discarded = 1;
        q->undelivered = 0;
        fr_client_settle_req_locked(c, q);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return FR_OK;
}

int fr_client_lost(const fr_client *c)
{
    if (!c) return 0;
    pthread_mutex_lock((pthread_mutex_t *)&c->mu);
    int lost = 0;
    for (int i = 0; i < c->n_reqs; i++) lost |= c->reqs[i]->lost && c->reqs[i]->unreceived > 0;
    pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
    return lost;
}

int fr_client_open_locked(const fr_client *c, const uint64_t *ids, int n)
{
    int open = 0;
    reader_walk w = walk_reader(c, ids, n);
    for (const req *q; (q = next_of_reader(&w));) open += q->undelivered > 0 ? q->undelivered : 0;
    return open;
}

static int open_samples(fr_client *c, const uint64_t *ids, int n)
{
    if (!c) return 0;
    pthread_mutex_lock(&c->mu);
    const int open = fr_client_open_locked(c, ids, n);
    pthread_mutex_unlock(&c->mu);
    return open;
}

int fr_client_open_samples(const fr_client *c) { return open_samples((fr_client *)c, NULL, 0); }

int fr_client_open_samples_of(fr_client *c, const uint64_t *ids, int n)
{
    return ids && n > 0 ? open_samples(c, ids, n) : 0;
}

int fr_client_open_requests(fr_client *c, uint64_t *ids, int cap)
{
    if (!c) return 0;
    pthread_mutex_lock(&c->mu);
    int n = 0;
    for (int i = 0; i < c->n_reqs; i++) {
        const req *q = c->reqs[i];
        if (q->discarded || q->owned || q->undelivered <= 0) continue;
        if (ids && n < cap) ids[n] = q->id;
        n++;
    }
    pthread_mutex_unlock(&c->mu);
    return n;
}
