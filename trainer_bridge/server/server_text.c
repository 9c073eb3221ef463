/* Text on the server (docs/protocol.md, generate's text keys): prompts given
 * as text encoded with the server's tokenizer, the stop strings and text a
 * request asks for handed to the engine (which matches and decodes:
 * rollout/engine/stop_strings.h), the text the engine reports streamed in
 * the tokens deltas, and each done's text and stop string. */
#include "trainer_bridge/server/server_internal.h"

#include <stdio.h>

static fr_status need_tokenizer(const fr_bridge_server *srv, uint64_t id, const char *what)
{
    if (srv->cfg.tokenizer) return FR_OK;
    return fr_fail(FR_EINVAL, "request %llu: %s needs the server's tokenizer, and this server has none (give serve "
                              "--tokenizer PATH, or serve a checkpoint folder holding a tokenizer.json)",
                   (unsigned long long)id, what);
}

fr_status srv_text_request(fr_bridge_server *srv, request *q, const fr_msg_generate *g)
{
    const uint64_t id = g->request_id;
    fr_status st = FR_OK;
    if (g->prompt_text) st = need_tokenizer(srv, id, "prompt_text");
    if (!st && g->stop) st = need_tokenizer(srv, id, "stop");
    if (!st && g->return_text) st = need_tokenizer(srv, id, "return_text");
    if (st) return st;
    q->return_text = g->return_text;
    q->include_stop = g->include_stop_str_in_output;
    q->keep_special = g->keep_special_tokens;
    if (g->stop) {
        if (!(q->stops = calloc((size_t)g->n_stop, sizeof *q->stops)))
            return fr_fail(FR_ENOMEM, "the server is out of memory");
        q->n_stops = g->n_stop;
        for (int i = 0; i < g->n_stop; i++)
            if (!(q->stops[i] = strdup(g->stop[i]))) return fr_fail(FR_ENOMEM, "the server is out of memory");
    }
    if (!g->prompt_text) return FR_OK;
    const int special = g->has_add_special_tokens ? g->add_special_tokens : 1;
    if ((st = fr_bridge_encode_prompt(srv->cfg.tokenizer, g->prompt_text, g->prompt_text_len, special, &q->prompt_ids,
                                      &q->n_prompt))) {
        char msg[FR_PROTO_TEXT_MAX];
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        return fr_fail(st, "request %llu: prompt_text: %s", (unsigned long long)id, msg);
    }
    return FR_OK;
}

fr_status fr_bridge_encode_prompt(const fr_tokenizer *tok, const char *text, size_t len, int add_special, int **ids,
                                  int *n)
{
    *ids = NULL;
    *n = 0;
    size_t m = 0;
    fr_status st = fr_tokenizer_encode(tok, text, len, add_special, ids, &m);
    if (st) return st == FR_ENOMEM ? FR_ENOMEM : FR_EINVAL;   /* the tokenizer's message stands */
    if (m == 0 || m > (size_t)FR_PROTO_MAX_ARRAY) {
        free(*ids);
        *ids = NULL;
        if (m == 0) return fr_fail(FR_EINVAL, "the text encodes to no token");
        return fr_fail(FR_EINVAL, "the text encodes to %zu tokens, more than %d", m, FR_PROTO_MAX_ARRAY);
    }
    *n = (int)m;
    return FR_OK;
}

const fr_tokenizer *fr_bridge_server_tokenizer(const fr_bridge_server *srv, const char **name)
{
    if (name) *name = srv->cfg.tokenizer && srv->cfg.tokenizer_name ? srv->cfg.tokenizer_name : "";
    return srv->cfg.tokenizer;
}

void srv_text_spec(const request *q, fr_request_spec *spec)
{
    spec->stop_strings = (fr_stop_strings){.s = (const char *const *)q->stops, .n = q->n_stops,
                                           .include = q->include_stop};
    spec->with_text = q->return_text;
    spec->keep_special = q->keep_special;
}

void srv_text_free(request *q)
{
    for (int i = 0; q->stops && i < q->n_stops; i++) free(q->stops[i]);
    free(q->stops);
    free(q->prompt_ids);
    for (int k = 0; q->s && k < q->n; k++) fr_buf_free(&q->s[k].text);
}

/* ---- between ranks ---------------------------------------------------------- */

void srv_put_text_spec(fr_rank_buf *b, const fr_request_spec *r)
{
    fr_rank_put_i32(b, r->with_text);
    fr_rank_put_i32(b, r->keep_special);
    fr_rank_put_i32(b, r->stop_strings.include);
    fr_rank_put_i32(b, r->stop_strings.n);
    for (int i = 0; i < r->stop_strings.n; i++)
        fr_rank_put_bytes(b, r->stop_strings.s[i], strlen(r->stop_strings.s[i]));
}

int srv_get_text_spec(fr_rank_reader *r, fr_request_spec *spec, char ***owned)
{
    *owned = NULL;
    spec->with_text = fr_rank_get_i32(r);
    spec->keep_special = fr_rank_get_i32(r);
    spec->stop_strings.include = fr_rank_get_i32(r);
    const int n = fr_rank_get_i32(r);
    if (r->bad || n < 0 || n > FR_PROTO_MAX_STOP) {
        r->bad = 1;
        return 0;
    }
    char **s = n ? calloc((size_t)n, sizeof *s) : NULL;
    if (n && !s) return -1;
    *owned = s;
    spec->stop_strings.s = (const char *const *)s;
    spec->stop_strings.n = n;
    for (int i = 0; i < n; i++) {
        size_t len = 0;
        const char *p = fr_rank_get_bytes(r, &len);
        if (!p) return 0;   /* truncated: r->bad says so */
        if (!(s[i] = malloc(len + 1))) return -1;
        memcpy(s[i], p, len);
        s[i][len] = '\0';
    }
    return 0;
}

void srv_free_strs(char **s, int n)
{
    for (int i = 0; s && i < n; i++) free(s[i]);
    free(s);
}

/* ---- text out ----------------------------------------------------------------- */

void srv_text_in(fr_bridge_server *srv, uint64_t sid, int sample, const char *text, size_t len)
{
    request *q = srv_find_sid(srv, sid);
    if (!q || sample < q->first_sample || sample - q->first_sample >= q->n) return;
    fr_buf *b = &q->s[sample - q->first_sample].text;
    fr_buf_put(b, text, len);
    if (b->failed) srv_log(srv, "out of memory keeping the text of request %llu", (unsigned long long)q->request_id);
}

void srv_on_text(void *user, uint64_t sid, int sample, int index, const char *text, size_t len)
{
    fr_bridge_server *srv = user;
    (void)index;   /* the text follows the token report it belongs to */
    if (!srv->multi) {
        srv_text_in(srv, sid, sample, text, len);
    } else if (srv->leader) {
        fr_rank_put_u8(&srv->outbox, OB_TEXT);
        fr_rank_put_u64(&srv->outbox, sid);
        fr_rank_put_i32(&srv->outbox, sample);
        fr_rank_put_bytes(&srv->outbox, text, len);
    }
}

void srv_take_text(fr_bridge_server *srv, fr_rank_reader *r)
{
    uint64_t sid = fr_rank_get_u64(r);
    int sample = fr_rank_get_i32(r);
    size_t len = 0;
    const char *p = fr_rank_get_bytes(r, &len);
    if (!r->bad && p) srv_text_in(srv, sid, sample, p, len);
}

void srv_text_delta(const request *q, sample_state *s, fr_msg_tokens *t)
{
    if (!q->return_text) return;
    const size_t have = s->text.failed ? s->text_sent : s->text.len;
    t->has_text = 1;
    t->text = s->text.data ? s->text.data + s->text_sent : NULL;
    t->text_len = have - s->text_sent;
    s->text_sent = have;
}

void srv_text_done(const request *q, const sample_state *s, const fr_sample_result *res, fr_msg_done *d)
{
    if (q->prompt_ids) {
        d->prompt_token_ids = q->prompt_ids;
        d->n_prompt_token_ids = q->n_prompt;
    }
    if (res && res->stop_string > 0 && res->stop_string <= q->n_stops) d->stop_str = q->stops[res->stop_string - 1];
    if (!q->return_text) return;
    d->has_text = 1;
    if (res && res->text) {   /* the engine's: what the stream held back at the end included */
        d->text = res->text;
        d->text_len = res->text_len;
    } else {                  /* ended outside the engine (held, a lost rank): what was streamed */
        d->text = s->text.data;
        d->text_len = s->text.failed ? s->text_sent : s->text.len;
    }
}
