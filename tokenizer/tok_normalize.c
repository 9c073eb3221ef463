/* Normalizers, run in order over a piece of text. Unicode normal forms come
 * from utf8proc, for the parts of a text they can change: ASCII and most
 * other characters are already in every normal form and pass through
 * without a copy. */
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "tok_internal.h"
#include "tok_utf8.h"

static int all_ascii(const char *s, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        if (w & 0x8080808080808080ull) return 0;
    }
    for (; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) return 0;
    return 1;
}

/* Whether normal form k may change c, or join it with the character before
 * it. Anything else (most of any text, all of CJK) is a boundary: the form
 * of a text is the form of its pieces between such characters, so only the
 * pieces around the others go through utf8proc. The characters that join
 * with a preceding one are marks (or have a combining class) and Hangul
 * medial and final jamo. */
static int may_change(tok_norm_kind k, uint32_t c)
{
    const utf8proc_property_t *p = utf8proc_get_property((utf8proc_int32_t)c);
    if (p->combining_class || p->category == UTF8PROC_CATEGORY_MN || p->category == UTF8PROC_CATEGORY_MC ||
        p->category == UTF8PROC_CATEGORY_ME)
        return 1;
    if ((c >= 0x1161 && c <= 0x1175) || (c >= 0x11A8 && c <= 0x11C2)) return 1;
    if (p->decomp_seqindex == UINT16_MAX) return (k == TOK_NORM_NFD || k == TOK_NORM_NFKD) && c >= 0xAC00 && c <= 0xD7A3;
    return p->decomp_type == 0 || k == TOK_NORM_NFKC || k == TOK_NORM_NFKD;
}

static fr_status utf8proc_form(tok_norm_kind k, const char *s, size_t n, fr_buf *dst)
{
    int opts = UTF8PROC_STABLE;
    if (k == TOK_NORM_NFC || k == TOK_NORM_NFKC) opts |= UTF8PROC_COMPOSE;
    else opts |= UTF8PROC_DECOMPOSE;
    if (k == TOK_NORM_NFKC || k == TOK_NORM_NFKD) opts |= UTF8PROC_COMPAT;
    utf8proc_uint8_t *res = NULL;
    utf8proc_ssize_t len = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &res,
                                        (utf8proc_option_t)opts);
    if (len < 0) {
        free(res);
        return fr_fail(len == UTF8PROC_ERROR_NOMEM ? FR_ENOMEM : FR_EINTERNAL, "normalizer: utf8proc: %s",
                       utf8proc_errmsg(len));
    }
    fr_buf_put(dst, res, (size_t)len);
    free(res);
    return FR_OK;
}

int tok_unicode_form(tok_norm_kind k, const char *s, size_t n, fr_buf *dst, fr_status *st)
{
    size_t copied = 0;      /* s[0 .. copied) is in dst */
    size_t boundary = 0;    /* the start of the last character before which nothing joins */
    int changed = 0;
    *st = FR_OK;
    for (size_t i = 0; i < n;) {
        if ((unsigned char)s[i] < 0x80) { boundary = i++; continue; }
        uint32_t c;
        int l = tok_utf8_next(s + i, &c);
        if (!may_change(k, c)) { boundary = i; i += (size_t)l; continue; }
        /* The piece from the boundary before to the next boundary after. */
        size_t end = i + (size_t)l;
        while (end < n) {
            uint32_t d;
            int dl = (unsigned char)s[end] < 0x80 ? (d = (unsigned char)s[end], 1) : tok_utf8_next(s + end, &d);
            if (d < 0x80 || !may_change(k, d)) break;
            end += (size_t)dl;
        }
        fr_buf_put(dst, s + copied, boundary - copied);
        if ((*st = utf8proc_form(k, s + boundary, end - boundary, dst)) != FR_OK) return 0;
        copied = boundary = end;
        i = end;
        changed = 1;
    }
    if (!changed) return 1;
    fr_buf_put(dst, s + copied, n - copied);
    return 0;
}

static fr_status replace(const tok_norm *z, tok_ws *ws, const char *s, size_t n, fr_buf *dst)
{
    fr_status st = tok_regex_matches(&z->re, &ws->rx, s, n, &ws->norm_segs);
    if (st != FR_OK) return st;
    for (size_t i = 0; i < ws->norm_segs.n; i++) {
        tok_seg g = ws->norm_segs.v[i];
        if (g.match) fr_buf_put(dst, z->text, z->text_len);
        else fr_buf_put(dst, s + g.s, g.e - g.s);
    }
    return FR_OK;
}

static void strip(const tok_norm *z, const char *s, size_t n, fr_buf *dst)
{
    size_t a = 0, b = n;
    while (z->left && a < b) {
        uint32_t cp;
        int k = tok_utf8_next(s + a, &cp);
        if (!tok_is_whitespace(cp)) break;
        a += (size_t)k;
    }
    while (z->right && b > a) {
        size_t last = tok_utf8_last_start(s, b);
        uint32_t cp;
        tok_utf8_next(s + last, &cp);
        if (!tok_is_whitespace(cp)) break;
        b = last;
    }
    fr_buf_put(dst, s + a, b - a);
}

/* Runs normalizer z over s into dst: 1 when it left s as it was (dst
 * untouched), 0 when dst holds the result, or a failure. */
static int run_one(const tok_norm *z, tok_ws *ws, const char *s, size_t n, fr_buf *dst, fr_status *st)
{
    *st = FR_OK;
    switch (z->kind) {
    case TOK_NORM_NFC: case TOK_NORM_NFD: case TOK_NORM_NFKC: case TOK_NORM_NFKD:
        if (all_ascii(s, n)) return 1;
        return tok_unicode_form(z->kind, s, n, dst, st);
    case TOK_NORM_PREPEND:
        if (!n) return 1;
        fr_buf_put(dst, z->text, z->text_len);
        fr_buf_put(dst, s, n);
        return 0;
    case TOK_NORM_REPLACE:
        *st = replace(z, ws, s, n, dst);
        return 0;
    case TOK_NORM_STRIP:
        strip(z, s, n, dst);
        return 0;
    case TOK_NORM_BYTE_LEVEL:
        tok_bytelevel_map(dst, s, n);
        return 0;
    }
    return 1;
}

fr_status tok_normalize(const fr_tokenizer *t, tok_ws *ws, const char *s, size_t n, const char **out,
                        size_t *out_len)
{
    const char *cur = s;
    size_t cur_len = n;
    for (size_t i = 0; i < t->n_norm; i++) {
        fr_buf *dst = cur == ws->norm_a.data ? &ws->norm_b : &ws->norm_a;
        dst->len = 0;
        fr_status st;
        if (run_one(&t->norm[i], ws, cur, cur_len, dst, &st)) continue;
        if (st != FR_OK) return st;
        if (dst->failed) {
            dst->failed = 0;
            return fr_fail(FR_ENOMEM, "out of memory normalizing %zu bytes of text", cur_len);
        }
        if (!dst->data) fr_buf_put(dst, "", 0);   /* an empty result still needs a buffer to point at */
        cur = dst->data;
        cur_len = dst->len;
    }
    *out = cur;
    *out_len = cur_len;
    return FR_OK;
}
