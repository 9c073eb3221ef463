/* Encoding, in tokenizers' order: added tokens that are matched on the raw
 * text split it first; each piece between them is normalized, then split
 * by the added tokens matched on normalized text; what is left is
 * pre-tokenized and goes through the model; last, the post-processor's
 * template adds its tokens. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

enum { TOK_MAX_TEXT = 1 << 30 };

static fr_status push_added(const fr_tokenizer *t, tok_ws *ws, uint32_t match)
{
    if (tok_ws_push_id(ws, t->added[match - 1].id) != 0) return fr_fail(FR_ENOMEM, "out of memory for token ids");
    return FR_OK;
}

/* One piece of raw text between added tokens; at_start: it begins the text. */
static fr_status encode_piece(const fr_tokenizer *t, tok_ws *ws, const char *s, size_t n, int at_start)
{
    const char *ns;
    size_t nn;
    fr_status st = tok_normalize(t, ws, s, n, &ns, &nn);
    if (st != FR_OK) return st;
    if ((st = tok_added_split(t, &t->norm_trie, ns, nn, &ws->nadded_segs)) != FR_OK) return st;
    for (size_t i = 0; i < ws->nadded_segs.n && st == FR_OK; i++) {
        tok_seg g = ws->nadded_segs.v[i];
        if (g.match) st = push_added(t, ws, g.match);
        else if (g.e > g.s) st = tok_pretok_run(t, ws, 0, ns + g.s, g.e - g.s, at_start && g.s == 0);
    }
    return st;
}

static fr_status encode_text(const fr_tokenizer *t, tok_ws *ws, const char *text, size_t len)
{
    fr_status st = tok_added_split(t, &t->raw_trie, text, len, &ws->added_segs);
    for (size_t i = 0; i < ws->added_segs.n && st == FR_OK; i++) {
        tok_seg g = ws->added_segs.v[i];
        if (g.match) st = push_added(t, ws, g.match);
        else if (g.e > g.s) st = encode_piece(t, ws, text + g.s, g.e - g.s, g.s == 0);
    }
    return st;
}

/* The result: ws's ids, inside the template when add_special. */
static fr_status finish(const fr_tokenizer *t, const tok_ws *ws, int add_special, int **ids, size_t *n)
{
    size_t total = ws->n_ids;
    int tmpl = add_special && t->has_tmpl;
    if (tmpl) total += t->n_tmpl - 1;
    if (!total) return FR_OK;
    int *out = malloc(total * sizeof *out);
    if (!out) return fr_fail(FR_ENOMEM, "out of memory for %zu token ids", total);
    if (!tmpl) {
        memcpy(out, ws->ids, ws->n_ids * sizeof *out);
    } else {
        size_t k = 0;
        for (size_t i = 0; i < t->n_tmpl; i++) {
            if (t->tmpl[i] != TOK_TMPL_SEQ) { out[k++] = t->tmpl[i]; continue; }
            if (ws->n_ids) memcpy(out + k, ws->ids, ws->n_ids * sizeof *out);
            k += ws->n_ids;
        }
    }
    *ids = out;
    *n = total;
    return FR_OK;
}

fr_status fr_tokenizer_encode(const fr_tokenizer *tok, const char *text, size_t len, int add_special, int **ids,
                              size_t *n)
{
    if (!ids || !n) return fr_fail(FR_EINVAL, "fr_tokenizer_encode: no place for the ids");
    *ids = NULL;
    *n = 0;
    if (!tok) return fr_fail(FR_EINVAL, "fr_tokenizer_encode: no tokenizer");
    if (!text && len) return fr_fail(FR_EINVAL, "fr_tokenizer_encode: no text");
    /* Offsets inside a text are 32-bit; normalizers may grow it. */
    if (len > TOK_MAX_TEXT) return fr_fail(FR_EINVAL, "text of %zu bytes is over the limit of %d bytes", len, TOK_MAX_TEXT);
    size_t ok = len ? tok_utf8_valid_prefix(text, len) : 0;
    if (ok != len) return fr_fail(FR_EINVAL, "text is not valid UTF-8 (byte %zu of %zu: 0x%02x)", ok, len,
                                  (unsigned)(unsigned char)text[ok]);
    tok_ws *ws = tok_ws_get(tok);
    if (!ws) return FR_ENOMEM;
    fr_status st = len ? encode_text(tok, ws, text, len) : FR_OK;
    if (st == FR_OK) st = finish(tok, ws, add_special, ids, n);
    tok_ws_put(tok, ws);
    return st;
}
