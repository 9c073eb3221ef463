/* The incremental detokenizer. It works as tokenizers' DecodeStream does,
 * so streamed text matches what a Python server built on it would send: it
 * keeps a short window of ids and the text they decode to (the prefix);
 * with a new id it decodes the window again, and when that text is longer
 * than the prefix and does not end in U+FFFD (the mark of a character or a
 * byte-fallback run still missing bytes), the part after the prefix is new
 * and final, and the window moves up to the ids that produced the prefix.
 * Decoding the window rather than one id keeps what depends on neighbours
 * right: a leading space that Metaspace or Strip drops from the first
 * token of a text but not from later ones. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

struct fr_detok {
    const fr_tokenizer *tok;
    int skip_special;
    int *ids;           /* the window */
    size_t n, cap;
    size_t prefix_index;
    fr_buf prefix;      /* the text of ids[0 .. prefix_index) once complete; empty until then */
    fr_buf cur;         /* scratch: the text of the whole window */
    fr_buf out;         /* what the last call handed out */
};

int fr_tokenizer_streams_exactly(const fr_tokenizer *tok)
{
    if (!tok) return 0;
    int joined = 0;   /* the list is one string, the whole text, from here on */
    for (size_t k = 0; k < tok->n_dec; k++) {
        const tok_dec *d = &tok->dec[k];
        switch (d->kind) {
        case TOK_DEC_BYTE_LEVEL:
        case TOK_DEC_FUSE: joined = 1; break;
        case TOK_DEC_STRIP:
            /* one leading character is safe: the window's text and the
             * text it grows into lose the same one */
            if (joined && (d->start > 1 || d->stop)) return 0;
            break;
        case TOK_DEC_REPLACE:
        case TOK_DEC_METASPACE:
            if (joined) return 0;
            break;
        case TOK_DEC_BPE: return 0;
        case TOK_DEC_BYTE_FALLBACK: break;
        }
    }
    return 1;
}

static int ends_with_replacement(const fr_buf *b)
{
    return b->len >= 3 && memcmp(b->data + b->len - 3, "\xEF\xBF\xBD", 3) == 0;
}

fr_status fr_detok_new(const fr_tokenizer *tok, int skip_special, fr_detok **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_detok_new: no place for the result");
    *out = NULL;
    if (!tok) return fr_fail(FR_EINVAL, "fr_detok_new: no tokenizer");
    fr_detok *d = calloc(1, sizeof *d);
    if (!d) return fr_fail(FR_ENOMEM, "out of memory for a detokenizer");
    d->tok = tok;
    d->skip_special = skip_special;
    *out = d;
    return FR_OK;
}

void fr_detok_free(fr_detok **d)
{
    if (!d || !*d) return;
    free((*d)->ids);
    fr_buf_free(&(*d)->prefix);
    fr_buf_free(&(*d)->cur);
    fr_buf_free(&(*d)->out);
    free(*d);
    *d = NULL;
}

/* The text of the window into b. */
static fr_status decode_window(fr_detok *d, size_t from, fr_buf *b)
{
    b->len = 0;
    return tok_decode_into(d->tok, d->n > from ? d->ids + from : NULL, d->n - from, d->skip_special, b);
}

static fr_status set_out(fr_detok *d, const char *s, size_t n, const char **text, size_t *len)
{
    d->out.len = 0;
    fr_buf_put(&d->out, s, n);
    if (d->out.failed) {
        d->out.failed = 0;
        return fr_fail(FR_ENOMEM, "out of memory for detokenized text");
    }
    *text = d->out.data;
    *len = n;
    return FR_OK;
}

fr_status fr_detok_push(fr_detok *d, int id, const char **text, size_t *len)
{
    if (!d || !text || !len) return fr_fail(FR_EINVAL, "fr_detok_push: no detokenizer or no place for the text");
    *text = "";
    *len = 0;
    fr_status st;
    if (!d->prefix.len && d->n) {
        /* The window's text may have become complete since it was set. */
        if ((st = decode_window(d, 0, &d->cur)) != FR_OK) return st;
        if (!ends_with_replacement(&d->cur)) {
            fr_buf swap = d->prefix;
            d->prefix = d->cur;
            d->cur = swap;
            d->prefix_index = d->n;
        }
    }
    int *v = fr_array_room(d->ids, d->n, &d->cap, sizeof *v, 16);
    if (!v) return fr_fail(FR_ENOMEM, "out of memory for the detokenizer's window");
    d->ids = v;
    d->ids[d->n++] = id;
    if ((st = decode_window(d, 0, &d->cur)) != FR_OK) return st;
    if (d->cur.len <= d->prefix.len || ends_with_replacement(&d->cur)) return FR_OK;
    if (memcmp(d->cur.data, d->prefix.data ? d->prefix.data : "", d->prefix.len) != 0)
        return fr_fail(FR_EINTERNAL, "detokenizer: the text of id %d does not extend the text before it", id);
    if ((st = set_out(d, d->cur.data + d->prefix.len, d->cur.len - d->prefix.len, text, len)) != FR_OK) return st;
    /* The window keeps the ids from the old prefix's end on; their text is the new prefix. */
    size_t keep_from = d->prefix_index, new_index = d->n - keep_from;
    memmove(d->ids, d->ids + keep_from, (d->n - keep_from) * sizeof *d->ids);
    d->n -= keep_from;
    if ((st = decode_window(d, 0, &d->prefix)) != FR_OK) return st;
    d->prefix_index = new_index;
    return FR_OK;
}

fr_status fr_detok_finish(fr_detok *d, const char **text, size_t *len)
{
    if (!d || !text || !len) return fr_fail(FR_EINVAL, "fr_detok_finish: no detokenizer or no place for the text");
    *text = "";
    *len = 0;
    fr_status st = decode_window(d, 0, &d->cur);
    if (st != FR_OK) return st;
    size_t skip = d->cur.len >= d->prefix.len && memcmp(d->cur.data, d->prefix.data ? d->prefix.data : "",
                                                         d->prefix.len) == 0 ? d->prefix.len : d->cur.len;
    st = set_out(d, d->cur.data + skip, d->cur.len - skip, text, len);
    d->n = 0;
    d->prefix_index = 0;
    d->prefix.len = 0;
    return st;
}
