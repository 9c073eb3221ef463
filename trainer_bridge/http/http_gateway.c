/* The HTTP API as a client of the serve loop (server.h, in-process
 * clients): client 0 sends every generation (one protocol generate per
 * prompt, with an id of the API's own) and its aborts; clients 1 to
 * HTTP_CTL_SLOTS carry one control call each. The loop's sink routes what
 * comes back by request id to the call's samples (tokens, dones, refusals),
 * or by client to the control call on that slot; a call's connection is
 * resumed when it has something to send. The text is the engine's: each
 * generate asks for it (return_text) when the server has a tokenizer, and
 * carries the call's stop strings, which the engine matches. */
#include "trainer_bridge/http/http_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <microhttpd.h>

struct http_route_entry {
    uint64_t id;
    http_call *c;
    int prompt;
    struct http_route_entry *next;
};
typedef struct http_route_entry entry;

/* ---- the table of engine requests -------------------------------------------- */

static size_t slot_of(const fr_http *h, uint64_t id) { return (size_t)((id * 0x9E3779B97F4A7C15ull) >> 32) % (size_t)h->table_size; }

static int table_put(fr_http *h, uint64_t id, http_call *c, int prompt)
{
    if (!h->table) {
        h->table_size = 8192;
        if (!(h->table = calloc((size_t)h->table_size, sizeof *h->table))) return -1;
    }
    entry *e = malloc(sizeof *e);
    if (!e) return -1;
    const size_t k = slot_of(h, id);
    *e = (entry){.id = id, .c = c, .prompt = prompt, .next = h->table[k]};
    h->table[k] = e;
    h->table_n++;
    return 0;
}

static entry *table_get(const fr_http *h, uint64_t id)
{
    if (!h->table) return NULL;
    for (entry *e = h->table[slot_of(h, id)]; e; e = e->next)
        if (e->id == id) return e;
    return NULL;
}

static void table_del(fr_http *h, uint64_t id)
{
    if (!h->table) return;
    for (entry **p = &h->table[slot_of(h, id)]; *p; p = &(*p)->next)
        if ((*p)->id == id) {
            entry *e = *p;
            *p = e->next;
            free(e);
            h->table_n--;
            return;
        }
}

void http_table_free(fr_http *h)
{
    for (int i = 0; h->table && i < h->table_size; i++)
        for (entry *e = h->table[i]; e;) {
            entry *next = e->next;
            free(e);
            e = next;
        }
    free(h->table);
    h->table = NULL;
}

/* ---- sending ---------------------------------------------------------------------- */

fr_status http_send(fr_http *h, int client, int trainer, const fr_msg *m)
{
    char *data;
    size_t len;
    fr_status st = fr_msg_encode(m, &data, &len);
    if (st) return st;
    st = fr_bridge_server_local_send(h->srv, client, trainer, data, len, NULL, 0);
    free(data);
    return st;
}

int http_take_slot(http_call *c)
{
    fr_http *h = c->h;
    for (int k = 1; k <= HTTP_CTL_SLOTS; k++)
        if (!h->slots[k]) {
            h->slots[k] = c;
            c->slot = k;
            return k;
        }
    return 0;
}

void http_release_slot(http_call *c)
{
    if (c->slot) c->h->slots[c->slot] = NULL;
    c->slot = 0;
}

/* Waits for client 0's next abort reply (c NULL: an abort of the API's own). */
static void expect_abort_reply(fr_http *h, http_call *c)
{
    if (h->n_aborts == h->cap_aborts) {
        int cap = h->cap_aborts ? h->cap_aborts * 2 : 64;
        http_call **v = realloc(h->aborts, sizeof *v * (size_t)cap);
        if (!v) return;   /* the reply then answers nobody: the abort itself went */
        h->aborts = v;
        h->cap_aborts = cap;
    }
    h->aborts[h->n_aborts++] = c;
}

/* Aborts the engine requests in ids[0, n) for waiter (NULL: nobody waits). */
void http_send_abort(fr_http *h, http_call *waiter, uint64_t *ids, int n)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_ABORT);
    m.u.abort.request_ids = ids;
    m.u.abort.n_request_ids = n;
    if (n > 0 && !http_send(h, 0, 0, &m)) expect_abort_reply(h, waiter);
    else if (n == 0 && waiter) {   /* abort every generation of the API's */
        m.u.abort.all = 1;
        m.u.abort.request_ids = NULL;
        if (!http_send(h, 0, 0, &m)) expect_abort_reply(h, waiter);
    }
}

void http_abort_open(http_call *c)
{
    uint64_t ids[256];
    int n = 0;
    for (int p = 0; p < c->gen.n_prompts; p++) {
        if (!c->req_open || !c->req_open[p]) continue;
        ids[n++] = c->req_id[p];
        if (n == 256) {
            http_send_abort(c->h, NULL, ids, n);
            n = 0;
        }
    }
    http_send_abort(c->h, NULL, ids, n);
}

/* ---- starting a generation ------------------------------------------------------------ */

/* Prompt p's generate message. SGLang's and vLLM's stop_token_ids stop
 * beside the model's EOS ids, which ignore_eos drops; the protocol's list
 * replaces the defaults, so it gets both. */
static int build_generate(http_call *c, int p, fr_msg *m, int *stops)
{
    const http_gen *g = &c->gen;
    fr_msg_init(m, FR_MSG_GENERATE);
    m->u.generate = g->g;
    fr_msg_generate *x = &m->u.generate;
    x->request_id = c->req_id[p];
    x->prompt = g->prompt[p];
    x->n_prompt = g->n_prompt[p];
    x->n = g->n;
    x->return_text = c->h->tok != NULL;
    int n = 0;
    if (g->g.has_stop_token_ids || g->ignore_eos) {
        for (int i = 0; i < g->g.n_stop_token_ids && n < 256; i++) stops[n++] = g->g.stop_token_ids[i];
        for (int i = 0; !g->ignore_eos && i < c->h->n_eos && n < 256; i++) stops[n++] = c->h->eos[i];
        x->has_stop_token_ids = 1;
        x->stop_token_ids = stops;
        x->n_stop_token_ids = n;
    }
    return 0;
}

static fr_status alloc_call(http_call *c)
{
    const http_gen *g = &c->gen;
    c->n_samples = g->n_prompts * g->n;
    c->s = calloc((size_t)c->n_samples, sizeof *c->s);
    c->req_id = calloc((size_t)g->n_prompts, sizeof *c->req_id);
    c->req_open = calloc((size_t)g->n_prompts, sizeof *c->req_open);
    if (!c->s || !c->req_id || !c->req_open) return fr_fail(FR_ENOMEM, "http: out of memory");
    for (int i = 0; i < c->n_samples; i++) c->s[i].sample = i % g->n;
    c->samples_left = c->n_samples;
    return FR_OK;
}

/* Encodes every prompt's generate first (a bad value is refused before
 * anything reaches the engine), then sends them. Under h->mu. */
void http_start_generation(http_call *c)
{
    fr_http *h = c->h;
    const http_gen *g = &c->gen;
    if (c->gen.n_prompts * (long long)c->gen.n > 65536) {
        http_fail(c, 400, "invalid_request_error", "n x prompts is %lld samples; at most 65536 in one call",
                  (long long)c->gen.n_prompts * c->gen.n);
        return;
    }
    fr_status st = alloc_call(c);
    char **frames = calloc((size_t)g->n_prompts, sizeof *frames);
    size_t *lens = calloc((size_t)g->n_prompts, sizeof *lens);
    if (!st && (!frames || !lens)) st = fr_fail(FR_ENOMEM, "http: out of memory");
    static int stops[256];   /* under h->mu: one user at a time */
    for (int p = 0; !st && p < g->n_prompts; p++) {
        c->req_id[p] = ++h->next_id;
        fr_msg m;
        build_generate(c, p, &m, stops);
        st = fr_msg_encode(&m, &frames[p], &lens[p]);
    }
    c->created = (long)time(NULL);
    snprintf(c->id, sizeof c->id, "%s-%016llx", g->api == API_OPENAI ? "cmpl" : "gen",
             (unsigned long long)(h->next_id * 0x9E3779B97F4A7C15ull));
    for (int p = 0; !st && p < g->n_prompts; p++) {
        if (table_put(h, c->req_id[p], c, p)) st = fr_fail(FR_ENOMEM, "http: out of memory");
        else if ((st = fr_bridge_server_local_send(h->srv, 0, 0, frames[p], lens[p], NULL, 0))) table_del(h, c->req_id[p]);
        if (!st) {
            c->req_open[p] = 1;
            c->n_open++;
        }
    }
    for (int p = 0; frames && p < g->n_prompts; p++) free(frames[p]);
    free(frames);
    free(lens);
    if (st) {
        char why[1024];
        snprintf(why, sizeof why, "%s", fr_last_error());
        http_abort_open(c);
        http_fail(c, st == FR_EIO ? 503 : 400, st == FR_EIO ? "unavailable" : "invalid_request_error", "%s", why);
    }
}

/* ---- what comes back ---------------------------------------------------------------- */

static void close_request(http_call *c, int p)
{
    if (!c->req_open[p]) return;
    c->req_open[p] = 0;
    c->n_open--;
    table_del(c->h, c->req_id[p]);
}

/* A stream starts with the first thing there is to send; a call that does
 * not stream answers once every sample ended. */
static void progress(http_call *c)
{
    if (c->state == CALL_READY) return;
    if (c->gen.stream && c->state == CALL_RUNNING) c->state = CALL_STREAMING;
    if (c->state == CALL_STREAMING) {
        http_wake(c);
        return;
    }
    if (c->samples_left > 0) return;
    http_view v = {.gen = &c->gen, .s = c->s, .n_samples = c->n_samples, .tok = c->h->tok,
                   .model = c->h->model_name, .id = c->id, .created = c->created};
    c->answer.len = 0;
    if (c->health) fr_buf_printf(&c->answer, "{\"status\":\"ok\"}");
    else if (c->gen.api == API_OPENAI) http_answer_completions(&v, &c->answer);
    else http_answer_generate(&v, &c->answer);
    http_ready(c, 200, "application/json");
}

static void end_sample(http_call *c, http_sample *s, fr_wire_finish why)
{
    if (s->ended) return;
    s->ended = 1;
    s->finish = why;
    s->dirty = 1;
    c->samples_left--;
}

static void take_tokens(http_call *c, int p, const fr_msg_tokens *t)
{
    const int n = c->gen.n;
    const int k = t->sample;
    if (k < 0 || k >= n) return;
    http_sample *s = &c->s[p * n + k];
    if (s->ended) return;
    /* out of memory: the done's count tells the tokens were lost */
    if (http_sample_append(s, t->token_ids, t->logprobs, t->weight_versions, t->n)) return;
    /* final text only: never half a character, nor a stop string's start */
    if (t->has_text && t->text_len) fr_buf_put(&s->text, t->text, t->text_len);
    s->dirty = 1;
}

/* The done's text is the whole sample's: the deltas' (a prefix of it, so
 * what was streamed stays valid) and what the engine held back, cut at the
 * stop string unless it is kept. */
static void take_done_text(http_sample *s, const fr_msg_done *d)
{
    if (d->has_text) {
        s->text.len = 0;
        fr_buf_put(&s->text, d->text ? d->text : "", d->text_len);
    }
    if (d->stop_str && !s->matched) s->matched = strdup(d->stop_str);
}

/* The done's routed experts, kept as they came (meta_info.routed_experts). */
static void take_done_routes(http_sample *s, const fr_msg_done *d)
{
    if (!d->routed_experts || s->routes || d->n_tokens != s->n) return;   /* lost tokens: no record fits */
    const size_t m = (size_t)d->n_tokens * (size_t)d->route_layers * (size_t)d->route_k * (size_t)d->route_width;
    if (!(s->routes = malloc(m ? m : 1))) return;   /* out of memory: the answer goes without them */
    memcpy(s->routes, d->routed_experts, m);
    s->route_layers = d->route_layers;
    s->route_k = d->route_k;
    s->route_width = d->route_width;
}

static void take_done(http_call *c, int p, const fr_msg_done *d)
{
    const int n = c->gen.n;
    if (d->sample < 0 || d->sample >= n) return;
    http_sample *s = &c->s[p * n + d->sample];
    if (s->ended) return;
    s->has_seed = d->has_seed;
    s->seed = d->seed;
    s->total_ms = d->total_ms;
    s->div = d->divergence;   /* a summary: kl is NULL, as no call asks for per_token_kl */
    if (d->top_k > 0 && d->top_token_ids && !s->top_ids) {
        const size_t m = (size_t)d->n_tokens * (size_t)d->top_k;
        s->top_ids = malloc(sizeof(int) * (m ? m : 1));
        s->top_lps = malloc(sizeof(float) * (m ? m : 1));
        if (s->top_ids && s->top_lps) {
            memcpy(s->top_ids, d->top_token_ids, sizeof(int) * m);
            memcpy(s->top_lps, d->top_logprobs, sizeof(float) * m);
            s->top_k = d->top_k;
        }
    }
    if (d->prompt_logprobs && d->n_prompt_logprobs > 0) {
        float *plp = malloc(sizeof(float) * (size_t)d->n_prompt_logprobs);
        if (plp) {
            memcpy(plp, d->prompt_logprobs, sizeof(float) * (size_t)d->n_prompt_logprobs);
            if (c->s[p * n].plp) free(c->s[p * n].plp);
            for (int j = 0; j < n; j++) {
                c->s[p * n + j].plp = plp;   /* sample 0 of the prompt owns it */
                c->s[p * n + j].n_plp = d->n_prompt_logprobs;
            }
        }
    }
    take_done_routes(s, d);
    take_done_text(s, d);
    if (d->finish_reason == FR_WIRE_ABORT) snprintf(s->why, sizeof s->why, "aborted");
    if (d->finish_reason == FR_WIRE_ERROR) snprintf(s->why, sizeof s->why, "the engine failed on this sample");
    end_sample(c, s, d->finish_reason);
}

/* A refused generate: every sample of it ends; a call that has sent
 * nothing yet answers with the refusal, and its other prompts are aborted. */
static void take_refusal(http_call *c, int p, const fr_msg_error *e)
{
    for (int j = 0; j < c->gen.n; j++) {
        http_sample *s = &c->s[p * c->gen.n + j];
        snprintf(s->why, sizeof s->why, "%.60s: %.180s", e->code, e->message);
        end_sample(c, s, FR_WIRE_ERROR);
    }
    close_request(c, p);
    if (c->state != CALL_RUNNING) return;
    http_abort_open(c);
    const int busy = !strcmp(e->code, "memory_released") || !strcmp(e->code, "shutdown") ||
                     !strcmp(e->code, "out_of_memory");
    http_fail(c, busy ? 503 : 400, busy ? "unavailable" : "invalid_request_error", "%s", e->message);
}

static void generation_msg(fr_http *h, const fr_msg *m)
{
    uint64_t id = m->type == FR_MSG_TOKENS ? m->u.tokens.request_id
                  : m->type == FR_MSG_DONE ? m->u.done.request_id
                                           : m->u.error.request_id;
    entry *e = table_get(h, id);
    if (!e) return;   /* a call that went away, or an abort's leftovers */
    http_call *c = e->c;
    const int p = e->prompt;
    if (m->type == FR_MSG_TOKENS) {
        take_tokens(c, p, &m->u.tokens);
    } else if (m->type == FR_MSG_DONE) {
        take_done(c, p, &m->u.done);
        int dones = 0;   /* the request closes with its last done */
        for (int j = 0; j < c->gen.n; j++) dones += c->s[p * c->gen.n + j].ended;
        if (dones == c->gen.n) close_request(c, p);
    } else {
        take_refusal(c, p, &m->u.error);
    }
    progress(c);
    http_maybe_free(c);
}

/* Client 0's abort replies go to whoever aborted, in order. */
static void abort_reply(fr_http *h, const fr_msg *m)
{
    if (h->n_aborts == 0) return;
    http_call *c = h->aborts[0];
    memmove(h->aborts, h->aborts + 1, sizeof *h->aborts * (size_t)(h->n_aborts - 1));
    h->n_aborts--;
    if (!c) return;
    c->waiting = 0;
    c->got = m->type;
    if (m->type == FR_MSG_ABORT_REPLY) c->u[0] = (uint64_t)m->u.abort_reply.samples;
    else snprintf(c->message, sizeof c->message, "%s", m->u.error.message);
    http_control_reply(c);
    http_maybe_free(c);
}

void http_on_msg(void *user, int client, const fr_msg *m)
{
    fr_http *h = user;
    pthread_mutex_lock(&h->mu);
    if (client == 0) {
        if (m->type == FR_MSG_TOKENS || m->type == FR_MSG_DONE ||
            (m->type == FR_MSG_ERROR && m->u.error.has_request_id))
            generation_msg(h, m);
        else if (m->type == FR_MSG_ABORT_REPLY || m->type == FR_MSG_ERROR)
            abort_reply(h, m);
    } else if (client <= HTTP_CTL_SLOTS && h->slots[client]) {
        http_call *c = h->slots[client];
        c->got = m->type;
        if (m->type == FR_MSG_ERROR) {
            snprintf(c->code, sizeof c->code, "%s", m->u.error.code);
            snprintf(c->message, sizeof c->message, "%s", m->u.error.message);
        } else if (m->type == FR_MSG_PAUSE_REPLY) {
            c->u[0] = (uint64_t)m->u.pause_reply.aborted;
        } else if (m->type == FR_MSG_RESUME_REPLY) {
            c->u[0] = (uint64_t)m->u.resume_reply.released;
        } else if (m->type == FR_MSG_UPDATE_REPLY) {
            c->u[0] = m->u.update_reply.weight_version;
            c->u[1] = m->u.update_reply.bytes;
        } else if (m->type == FR_MSG_STATS_REPLY || m->type == FR_MSG_HELLO_REPLY) {
            c->message[0] = '\0';
            if (m->type == FR_MSG_STATS_REPLY) c->u[2] = m->u.stats_reply.weight_version;
            c->u[3] = (uint64_t)(uintptr_t)m;   /* read by http_control_reply during this call only */
        }
        c->waiting = 0;
        http_control_reply(c);
        c->u[3] = 0;
        http_maybe_free(c);
    }
    pthread_mutex_unlock(&h->mu);
}

void http_on_command(void *user, int client, const char *code, const char *message)
{
    fr_http *h = user;
    pthread_mutex_lock(&h->mu);
    http_call *c = client >= 1 && client <= HTTP_CTL_SLOTS ? h->slots[client] : NULL;
    if (c) {
        c->got = FR_MSG_NONE;
        snprintf(c->code, sizeof c->code, "%s", code);
        snprintf(c->message, sizeof c->message, "%s", message);
        c->waiting = 0;
        http_control_reply(c);
        http_maybe_free(c);
    }
    pthread_mutex_unlock(&h->mu);
}

/* ---- streams ------------------------------------------------------------------------- */

int http_stream_read(http_call *c, char *buf, size_t max)
{
    if (c->out_off == c->out.len) {
        c->out.len = c->out_off = 0;
        http_view v = {.gen = &c->gen, .s = c->s, .n_samples = c->n_samples, .tok = c->h->tok,
                       .model = c->h->model_name, .id = c->id, .created = c->created};
        for (int i = 0; i < c->n_samples; i++) {
            if (!c->s[i].dirty) continue;
            c->s[i].dirty = 0;
            if (c->s[i].final_sent) continue;
            if (c->gen.api == API_OPENAI) http_chunk_completions(&v, i, &c->out);
            else http_chunk_generate(&v, i, &c->out);
        }
        if (c->samples_left == 0 && !c->end_written) {
            int all = 1;
            for (int i = 0; i < c->n_samples; i++) all &= c->s[i].final_sent;
            if (all) {
                if (c->gen.include_usage) http_chunk_usage(&v, &c->out);
                fr_buf_printf(&c->out, "data: [DONE]\n\n");
                c->end_written = 1;
            }
        }
    }
    if (c->out_off < c->out.len) {
        size_t n = c->out.len - c->out_off;
        if (n > max) n = max;
        memcpy(buf, c->out.data + c->out_off, n);
        c->out_off += n;
        return (int)n;
    }
    if (c->end_written || c->out.failed) return -1;
    if (c->conn) {
        c->suspended = 1;
        MHD_suspend_connection(c->conn);
    }
    return 0;
}
