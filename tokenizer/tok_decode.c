/* Decoding: ids to their token strings, then the decoders in order, each
 * turning a list of strings into another (tokenizers' decode_chain), then
 * the list joined. A list is a buffer and the spans of its strings; two of
 * them take turns as input and output. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

typedef tok_strlist tok_list;

static int list_add(tok_list *l, const char *s, size_t n)
{
    size_t at = l->text.len;
    fr_buf_put(&l->text, s, n);
    return l->text.failed ? -1 : tok_segs_push(&l->spans, (uint32_t)at, (uint32_t)l->text.len, 0);
}

/* Appends to the list's last string (which must be the one being built). */
static void list_extend(tok_list *l, const char *s, size_t n)
{
    fr_buf_put(&l->text, s, n);
    if (!l->text.failed) l->spans.v[l->spans.n - 1].e = (uint32_t)l->text.len;
}

#define SPAN(l, i) ((l)->text.data + (l)->spans.v[i].s)
#define SPAN_LEN(l, i) ((size_t)((l)->spans.v[i].e - (l)->spans.v[i].s))

/* ByteLevel: every token back to its bytes (a token with a character
 * outside the byte alphabet, an added token say, stays as it is), all of
 * them one string, invalid UTF-8 replaced. */
static int dec_byte_level(const tok_list *in, tok_list *out, fr_buf *tmp)
{
    tmp->len = 0;
    for (size_t i = 0; i < in->spans.n; i++) {
        const char *s = SPAN(in, i);
        size_t n = SPAN_LEN(in, i), at = tmp->len;
        for (size_t k = 0; k < n;) {
            uint32_t cp;
            k += (size_t)tok_utf8_next(s + k, &cp);
            int b = tok_char_byte(cp);
            if (b < 0) {
                tmp->len = at;
                fr_buf_put(tmp, s, n);
                break;
            }
            unsigned char byte = (unsigned char)b;
            fr_buf_put(tmp, &byte, 1);
        }
    }
    if (tmp->failed || list_add(out, "", 0) != 0) return -1;
    fr_buf lossy = {0};
    tok_utf8_lossy(&lossy, tmp->data ? tmp->data : "", tmp->len);
    list_extend(out, lossy.data ? lossy.data : "", lossy.len);
    int bad = lossy.failed;
    fr_buf_free(&lossy);
    return bad ? -1 : 0;
}

/* The byte of a "<0xNN>" token as Rust's u8::from_str_radix reads NN, or -1. */
static int byte_token(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0, digits = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) {
            if (i == 3 && c == '+') continue;   /* a leading plus sign parses */
            return -1;
        }
        v = 16 * v + d;
        digits++;
    }
    return digits ? v : -1;
}

/* A run of byte tokens: one string when its bytes are UTF-8, else one
 * U+FFFD per byte. */
static int flush_bytes(tok_list *out, fr_buf *bytes)
{
    if (!bytes->len) return 0;
    int r;
    if (tok_utf8_valid_prefix(bytes->data, bytes->len) == bytes->len) {
        r = list_add(out, bytes->data, bytes->len);
    } else {
        r = 0;
        for (size_t k = 0; k < bytes->len && !r; k++) r = list_add(out, "\xEF\xBF\xBD", 3);
    }
    bytes->len = 0;
    return r;
}

static int dec_byte_fallback(const tok_list *in, tok_list *out, fr_buf *bytes)
{
    bytes->len = 0;
    for (size_t i = 0; i < in->spans.n; i++) {
        int b = byte_token(SPAN(in, i), SPAN_LEN(in, i));
        if (b >= 0) {
            unsigned char byte = (unsigned char)b;
            fr_buf_put(bytes, &byte, 1);
            continue;
        }
        if (flush_bytes(out, bytes) != 0 || list_add(out, SPAN(in, i), SPAN_LEN(in, i)) != 0) return -1;
    }
    return bytes->failed || flush_bytes(out, bytes) != 0 ? -1 : 0;
}

static int dec_strip(const tok_dec *d, const tok_list *in, tok_list *out)
{
    char c[4];
    size_t cl = (size_t)tok_utf8_put(d->ch, c);
    for (size_t i = 0; i < in->spans.n; i++) {
        const char *s = SPAN(in, i);
        size_t a = 0, b = SPAN_LEN(in, i);
        for (int k = 0; k < d->start && b - a >= cl && memcmp(s + a, c, cl) == 0; k++) a += cl;
        for (int k = 0; k < d->stop && b - a >= cl && memcmp(s + b - cl, c, cl) == 0; k++) b -= cl;
        if (list_add(out, s + a, b - a) != 0) return -1;
    }
    return 0;
}

static int dec_replace(const tok_dec *d, tok_ws *ws, const tok_list *in, tok_list *out)
{
    for (size_t i = 0; i < in->spans.n; i++) {
        const char *s = SPAN(in, i);
        if (tok_regex_matches(&d->re, &ws->rx, s, SPAN_LEN(in, i), &ws->norm_segs) != FR_OK ||
            list_add(out, "", 0) != 0)
            return -1;
        for (size_t k = 0; k < ws->norm_segs.n; k++) {
            tok_seg g = ws->norm_segs.v[k];
            if (g.match) list_extend(out, d->text, d->text_len);
            else list_extend(out, s + g.s, g.e - g.s);
        }
    }
    return 0;
}

/* Metaspace: the replacement character back to a space, except in the
 * first string, where (unless prepend_scheme is never) it is dropped. */
static int dec_metaspace(const tok_dec *d, const tok_list *in, tok_list *out)
{
    char c[4];
    size_t cl = (size_t)tok_utf8_put(d->ch, c);
    for (size_t i = 0; i < in->spans.n; i++) {
        const char *s = SPAN(in, i);
        size_t n = SPAN_LEN(in, i), from = 0;
        if (list_add(out, "", 0) != 0) return -1;
        for (size_t k = 0; k + cl <= n;) {
            if (memcmp(s + k, c, cl) != 0) { k += (size_t)tok_utf8_len((unsigned char)s[k]); continue; }
            list_extend(out, s + from, k - from);
            if (i > 0 || d->prepend == TOK_PREPEND_NEVER) list_extend(out, " ", 1);
            k += cl;
            from = k;
        }
        list_extend(out, s + from, n - from);
    }
    return 0;
}

/* BPEDecoder: the end-of-word suffix becomes a space, nothing in the last string. */
static int dec_bpe(const tok_dec *d, const tok_list *in, tok_list *out)
{
    for (size_t i = 0; i < in->spans.n; i++) {
        const char *s = SPAN(in, i);
        size_t n = SPAN_LEN(in, i), from = 0;
        int last = i + 1 == in->spans.n;
        if (list_add(out, "", 0) != 0) return -1;
        for (size_t k = 0; d->text_len && k + d->text_len <= n;) {
            if (memcmp(s + k, d->text, d->text_len) != 0) { k++; continue; }
            list_extend(out, s + from, k - from);
            if (!last) list_extend(out, " ", 1);
            k += d->text_len;
            from = k;
        }
        list_extend(out, s + from, n - from);
    }
    return 0;
}

static int run_decoder(const tok_dec *d, tok_ws *ws, const tok_list *in, tok_list *out)
{
    switch (d->kind) {
    case TOK_DEC_BYTE_LEVEL: return dec_byte_level(in, out, &ws->word);
    case TOK_DEC_BYTE_FALLBACK: return dec_byte_fallback(in, out, &ws->word);
    case TOK_DEC_FUSE:
        if (list_add(out, "", 0) != 0) return -1;
        for (size_t i = 0; i < in->spans.n; i++) list_extend(out, SPAN(in, i), SPAN_LEN(in, i));
        return 0;
    case TOK_DEC_STRIP: return dec_strip(d, in, out);
    case TOK_DEC_REPLACE: return dec_replace(d, ws, in, out);
    case TOK_DEC_METASPACE: return dec_metaspace(d, in, out);
    case TOK_DEC_BPE: return dec_bpe(d, in, out);
    }
    return -1;
}

/* The token strings of ids: the list decoders start from. */
static int token_list(const fr_tokenizer *t, const int *ids, size_t n, int skip_special, tok_list *l)
{
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *s = fr_tokenizer_id_token(t, ids[i], &len);
        if (!s || (skip_special && t->id_special[ids[i]])) continue;
        if (list_add(l, s, len) != 0) return -1;
    }
    return 0;
}

fr_status tok_decode_into(const fr_tokenizer *t, const int *ids, size_t n, int skip_special, fr_buf *out)
{
    tok_ws *ws = tok_ws_get(t);
    if (!ws) return FR_ENOMEM;
    /* The workspace's lists: a detokenizer decodes a few ids at a time,
     * many times over, and should not allocate each time. */
    tok_list *in = (tok_list *)&ws->dec[0], *next = (tok_list *)&ws->dec[1];
    in->text.len = next->text.len = 0;
    in->spans.n = next->spans.n = 0;
    int bad = token_list(t, ids, n, skip_special, in);
    for (size_t k = 0; !bad && k < t->n_dec; k++) {
        next->text.len = 0;
        next->spans.n = 0;
        bad = run_decoder(&t->dec[k], ws, in, next) != 0 || next->text.failed;
        tok_list *swap = in;
        in = next;
        next = swap;
    }
    /* Without a decoder tokenizers joins the tokens with spaces. */
    for (size_t i = 0; !bad && i < in->spans.n; i++) {
        if (i && !t->has_decoder) fr_buf_put(out, " ", 1);
        fr_buf_put(out, SPAN(in, i), SPAN_LEN(in, i));
    }
    if (!out->data) fr_buf_put(out, "", 0);
    bad |= out->failed || in->text.failed || next->text.failed;
    in->text.failed = next->text.failed = 0;
    tok_ws_put(t, ws);
    return bad ? fr_fail(FR_ENOMEM, "out of memory decoding %zu ids", n) : FR_OK;
}

fr_status fr_tokenizer_decode(const fr_tokenizer *tok, const int *ids, size_t n, int skip_special, char **text,
                              size_t *len)
{
    if (!text || !len) return fr_fail(FR_EINVAL, "fr_tokenizer_decode: no place for the text");
    *text = NULL;
    *len = 0;
    if (!tok || (!ids && n)) return fr_fail(FR_EINVAL, "fr_tokenizer_decode: no tokenizer or no ids");
    fr_buf out = {0};
    fr_status st = tok_decode_into(tok, ids, n, skip_special, &out);
    if (st != FR_OK) {
        fr_buf_free(&out);
        return st;
    }
    *text = out.data;
    *len = out.len;
    return FR_OK;
}
