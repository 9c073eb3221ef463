/* Text in and out of the HTTP API (http_internal.h): the one glue between
 * the API and the tokenizer module. A model folder's tokenizer.json is
 * loaded with tokenizer/; a byte-level model (ids 0-255 are bytes, BOS 256:
 * the bundled demo model, the test models) needs none. Anything else
 * serves token ids only. */
#include "trainer_bridge/http/http_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NONE = 0, TOKENIZER, BYTES };

struct http_text {
    int kind;
    int bos;
    fr_tokenizer *tok;
};

struct http_detok {
    const http_text *t;
    int skip_special;
    fr_detok *d;                /* TOKENIZER */
    unsigned char held[4];      /* BYTES: an incomplete UTF-8 character */
    int n_held;
};

fr_status http_text_new(const char *model_dir, int vocab, int bos, http_text **out)
{
    http_text *t = calloc(1, sizeof *t);
    if (!t) return fr_fail(FR_ENOMEM, "http: out of memory");
    t->bos = bos;
    char path[4096];
    if (model_dir && snprintf(path, sizeof path, "%s/tokenizer.json", model_dir) < (int)sizeof path &&
        access(path, R_OK) == 0) {
        fr_status st = fr_tokenizer_load(model_dir, &t->tok);
        if (st) {
            free(t);
            return st;
        }
        t->kind = TOKENIZER;
    } else if (bos == 256 && vocab > 256 && vocab <= 512) {
        t->kind = BYTES;
    }
    *out = t;
    return FR_OK;
}

void http_text_free(http_text **pt)
{
    if (!pt || !*pt) return;
    fr_tokenizer_free(&(*pt)->tok);
    free(*pt);
    *pt = NULL;
}

int http_text_has(const http_text *t) { return t && t->kind != NONE; }

const char *http_text_kind(const http_text *t)
{
    return !t ? "none" : t->kind == TOKENIZER ? "tokenizer.json" : t->kind == BYTES ? "bytes" : "none";
}

fr_status http_text_encode(const http_text *t, const char *s, size_t n, int **ids, int *n_ids)
{
    *ids = NULL;
    *n_ids = 0;
    if (!http_text_has(t))
        return fr_fail(FR_EINVAL, "this model has no tokenizer (no tokenizer.json beside it, and it is not "
                                  "byte-level): send token ids (input_ids, or a prompt of ids)");
    if (t->kind == TOKENIZER) {
        size_t m = 0;
        fr_status st = fr_tokenizer_encode(t->tok, s, n, 1, ids, &m);
        if (st) return st;
        if (m > (size_t)(1 << 24)) {
            free(*ids);
            *ids = NULL;
            return fr_fail(FR_EINVAL, "the text is %zu tokens, more than 2^24", m);
        }
        *n_ids = (int)m;
        return FR_OK;
    }
    if (n > (size_t)(1 << 24)) return fr_fail(FR_EINVAL, "the text is longer than 16 MiB");
    int *v = malloc(sizeof(int) * (n + 1));
    if (!v) return fr_fail(FR_ENOMEM, "http: out of memory");
    v[0] = t->bos;   /* every sequence of a byte-level model starts with BOS */
    for (size_t i = 0; i < n; i++) v[i + 1] = (unsigned char)s[i];
    *ids = v;
    *n_ids = (int)n + 1;
    return FR_OK;
}

fr_status http_detok_new(const http_text *t, int skip_special, http_detok **out)
{
    *out = NULL;
    if (!http_text_has(t)) return FR_OK;   /* no text: nothing to decode */
    http_detok *d = calloc(1, sizeof *d);
    if (!d) return fr_fail(FR_ENOMEM, "http: out of memory");
    d->t = t;
    d->skip_special = skip_special;
    if (t->kind == TOKENIZER) {
        fr_status st = fr_detok_new(t->tok, skip_special, &d->d);
        if (st) {
            free(d);
            return st;
        }
    }
    *out = d;
    return FR_OK;
}

/* The length of the UTF-8 character lead byte c starts (0: not a lead byte). */
static int utf8_len(unsigned char c)
{
    return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
}

static const char replacement[] = "\xEF\xBF\xBD";   /* U+FFFD */

/* Bytes out as UTF-8: whole characters as they complete; a byte that
 * cannot start or continue one becomes U+FFFD (what Hugging Face's
 * decoding does with bytes that are not UTF-8). */
static void push_byte(http_detok *d, unsigned char c, fr_buf *out)
{
    if (d->n_held > 0) {
        if ((c & 0xC0) == 0x80) {
            d->held[d->n_held++] = c;
            if (d->n_held == utf8_len(d->held[0])) {
                fr_buf_put(out, d->held, (size_t)d->n_held);
                d->n_held = 0;
            }
            return;
        }
        fr_buf_put(out, replacement, 3);
        d->n_held = 0;
    }
    const int need = utf8_len(c);
    if (need == 1) fr_buf_put(out, &c, 1);
    else if (need == 0) fr_buf_put(out, replacement, 3);
    else d->held[d->n_held++] = c;
}

fr_status http_detok_push(http_detok *d, int id, fr_buf *out)
{
    if (!d) return FR_OK;
    if (d->t->kind == BYTES) {
        if (id >= 0 && id < 256) push_byte(d, (unsigned char)id, out);
        return FR_OK;   /* ids past the bytes are the model's special tokens: no text */
    }
    const char *s;
    size_t n;
    fr_status st = fr_detok_push(d->d, id, &s, &n);
    if (!st && n) fr_buf_put(out, s, n);
    return st;
}

fr_status http_detok_finish(http_detok *d, fr_buf *out)
{
    if (!d) return FR_OK;
    if (d->t->kind == BYTES) {
        if (d->n_held) fr_buf_put(out, replacement, 3);
        d->n_held = 0;
        return FR_OK;
    }
    const char *s;
    size_t n;
    fr_status st = fr_detok_finish(d->d, &s, &n);
    if (!st && n) fr_buf_put(out, s, n);
    return st;
}

void http_detok_free(http_detok **pd)
{
    if (!pd || !*pd) return;
    fr_detok_free(&(*pd)->d);
    free(*pd);
    *pd = NULL;
}

void http_text_token(const http_text *t, int id, fr_buf *out)
{
    if (!http_text_has(t)) return;
    if (t->kind == BYTES) {
        if (id >= 0 && id < 256) {
            unsigned char c = (unsigned char)id;
            fr_buf_put(out, &c, 1);   /* half a character is made valid by the JSON writer */
        }
        return;
    }
    char *s = NULL;
    size_t n = 0;
    if (!fr_tokenizer_decode(t->tok, &id, 1, 0, &s, &n)) fr_buf_put(out, s, n);
    free(s);
}

void http_text_decode(const http_text *t, const int *ids, int n, int skip_special, fr_buf *out)
{
    http_detok *d = NULL;
    if (http_detok_new(t, skip_special, &d) || !d) return;
    for (int i = 0; i < n; i++) http_detok_push(d, ids[i], out);
    http_detok_finish(d, out);
    http_detok_free(&d);
}
