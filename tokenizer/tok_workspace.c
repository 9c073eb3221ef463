/* Workspaces: the mutable state of one encode call (regular expression
 * match state, scratch buffers, the pre-token cache). A tokenizer keeps the
 * idle ones in a pool: a call takes one (or makes one when all are busy)
 * and gives it back, so concurrent callers never share one, a lone caller
 * keeps hitting the same warm cache, and the lock is taken twice per call,
 * not once per word. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

void tok_ws_free(tok_ws *ws)
{
    if (!ws) return;
    tok_rx_ctx_free(&ws->rx);
    fr_buf_free(&ws->norm_a);
    fr_buf_free(&ws->norm_b);
    free(ws->added_segs.v);
    free(ws->norm_segs.v);
    free(ws->nadded_segs.v);
    if (ws->stages) {
        for (size_t i = 0; i < ws->n_stages; i++) {
            fr_buf_free(&ws->stages[i].a);
            fr_buf_free(&ws->stages[i].b);
            free(ws->stages[i].segs.v);
            free(ws->stages[i].segs2.v);
        }
        free(ws->stages);
    }
    fr_buf_free(&ws->word);
    fr_buf_free(&ws->mapped);
    free(ws->ids);
    free(ws->sym);
    free(ws->heap);
    tok_cache_free(&ws->cache);
    for (int i = 0; i < 2; i++) {
        fr_buf_free(&ws->dec[i].text);
        free(ws->dec[i].spans.v);
    }
    free(ws);
}

static tok_ws *ws_new(const fr_tokenizer *t)
{
    tok_ws *ws = calloc(1, sizeof *ws);
    if (!ws) return NULL;
    /* One stage per pre-tokenizer, and the model's. */
    ws->n_stages = t->n_pre + 1;
    ws->stages = calloc(ws->n_stages, sizeof *ws->stages);
    if (!ws->stages) { free(ws); return NULL; }
    if (tok_rx_ctx_init(&ws->rx) != FR_OK) {
        tok_ws_free(ws);
        return NULL;
    }
    return ws;
}

tok_ws *tok_ws_get(const fr_tokenizer *t)
{
    fr_tokenizer *m = (fr_tokenizer *)t;   /* the pool is the one mutable part */
    tok_ws *ws = NULL;
    pthread_mutex_lock(&m->pool_lock);
    if (m->n_pool) ws = m->pool[--m->n_pool];
    pthread_mutex_unlock(&m->pool_lock);
    if (!ws) ws = ws_new(t);
    if (!ws) fr_fail(FR_ENOMEM, "out of memory for a tokenizer workspace");
    else ws->n_ids = 0;
    return ws;
}

void tok_ws_put(const fr_tokenizer *t, tok_ws *ws)
{
    fr_tokenizer *m = (fr_tokenizer *)t;
    pthread_mutex_lock(&m->pool_lock);
    tok_ws **p = fr_array_room(m->pool, m->n_pool, &m->cap_pool, sizeof *p, 4);
    if (p) m->pool = p;
    if (m->n_pool < m->cap_pool) {
        m->pool[m->n_pool++] = ws;
        ws = NULL;
    }
    pthread_mutex_unlock(&m->pool_lock);
    tok_ws_free(ws);   /* the pool could not grow: let this one go */
}
