#include "tok_regex.h"

#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "tok_utf8.h"

/* Oniguruma's \s (the White_Space property), and its \w, as class bodies. */
#define WS_BODY "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define WORD_BODY "\\p{L}\\p{M}\\p{N}\\p{Pc}"
#define HEX_BODY "0-9a-fA-F"

static int is_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

/* One escape at p[i] == '\\' (i + 1 < len): appends its translation and
 * returns how many pattern bytes it used, or 0 when it cannot be
 * translated. */
static size_t translate_escape(fr_buf *o, const char *p, size_t i, size_t len, int in_class)
{
    char c = p[i + 1];
    const char *body = c == 's' || c == 'S' ? WS_BODY : c == 'w' || c == 'W' ? WORD_BODY
                     : c == 'h' || c == 'H' ? HEX_BODY : NULL;
    if (body) {
        int negated = c == 'S' || c == 'W' || c == 'H';
        if (!in_class) {
            fr_buf_printf(o, "[%s%s]", negated ? "^" : "", body);
        } else if (!negated) {
            fr_buf_printf(o, "%s", body);
        } else if (c == 'H') {
            fr_fail(FR_EUNSUPPORTED, "\\H inside a character class");
            return 0;
        } else {
            /* A negated set cannot nest in a PCRE2 class; PCRE2's own \S and
             * \W differ from Oniguruma's only at U+180E and at marks. */
            fr_buf_put(o, p + i, 2);
        }
        return 2;
    }
    if (c == 'u' && i + 5 < len && is_hex(p[i + 2]) && is_hex(p[i + 3]) && is_hex(p[i + 4]) &&
        is_hex(p[i + 5])) {
        fr_buf_printf(o, "\\x{%.4s}", p + i + 2);
        return 6;
    }
    /* Anything else means the same to both engines: copy the backslash and
     * the whole character after it. */
    size_t n = 1 + (size_t)tok_utf8_len((unsigned char)c);
    if (i + n > len) n = len - i;
    fr_buf_put(o, p + i, n);
    return n;
}

char *tok_regex_translate(const char *p, size_t len, size_t *out_len)
{
    fr_buf o = {0};
    int in_class = 0;
    size_t class_start = 0;   /* where the current class's items begin */
    for (size_t i = 0; i < len;) {
        char c = p[i];
        if (c == '\\' && i + 1 < len) {
            size_t used = translate_escape(&o, p, i, len, in_class);
            if (!used) goto refuse;
            i += used;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = 1;
            fr_buf_put(&o, "[", 1);
            i++;
            if (i < len && p[i] == '^') { fr_buf_put(&o, "^", 1); i++; }
            class_start = i;
            continue;
        }
        if (in_class) {
            if (c == ']' && i > class_start) in_class = 0;
            else if (c == '[' && i + 1 < len && p[i + 1] == ':') {
                const char *end = memchr(p + i + 2, ']', len - i - 2);
                size_t n = end ? (size_t)(end - (p + i)) + 1 : len - i;
                fr_buf_put(&o, p + i, n);
                i += n;
                continue;
            } else if (c == '[') {
                fr_fail(FR_EUNSUPPORTED, "a character class nested in another (Oniguruma set operations)");
                goto refuse;
            } else if (c == '&' && i + 1 < len && p[i + 1] == '&') {
                fr_fail(FR_EUNSUPPORTED, "a class intersection (&&)");
                goto refuse;
            }
        }
        fr_buf_put(&o, p + i, 1);
        i++;
    }
    if (o.failed) {
        fr_fail(FR_ENOMEM, "out of memory translating a pattern");
        goto refuse;
    }
    if (!o.data) fr_buf_put(&o, "", 0);
    if (o.failed) goto refuse;
    *out_len = o.len;
    return o.data;
refuse:
    fr_buf_free(&o);
    return NULL;
}

fr_status tok_regex_compile(tok_regex *re, const char *pattern, size_t len, int literal, const char *what)
{
    re->code = NULL;
    char *tr = NULL;
    size_t tr_len = len;
    if (!literal) {
        tr = tok_regex_translate(pattern, len, &tr_len);
        if (!tr) return fr_fail(FR_EUNSUPPORTED, "%s: pattern /%.*s/ uses %s", what, (int)len, pattern, fr_last_error());
    }
    int err;
    PCRE2_SIZE at;
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    re->code = pcre2_compile((PCRE2_SPTR)(tr ? tr : pattern), tr_len, opts, &err, &at, NULL);
    free(tr);
    if (!re->code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return fr_fail(FR_EFORMAT, "%s: pattern /%.*s/ does not compile: %s (at offset %zu)", what, (int)len, pattern,
                       (const char *)msg, (size_t)at);
    }
    /* Without a JIT (some platforms) PCRE2's interpreter gives the same
     * matches, only slower. FR_TOKENIZER_NO_JIT=1 turns it off on purpose:
     * valgrind takes the JIT's generated code for reads of uninitialised
     * memory. */
    const char *no_jit = getenv("FR_TOKENIZER_NO_JIT");
    if (!no_jit || strcmp(no_jit, "1") != 0) (void)pcre2_jit_compile(re->code, PCRE2_JIT_COMPLETE);
    return FR_OK;
}

void tok_regex_free(tok_regex *re)
{
    if (re->code) pcre2_code_free(re->code);
    re->code = NULL;
}

fr_status tok_rx_ctx_init(tok_rx_ctx *c)
{
    c->md = pcre2_match_data_create(1, NULL);
    c->mctx = pcre2_match_context_create(NULL);
    /* Long runs of one class (spaces, digits) backtrack over the JIT stack:
     * room for texts of many megabytes. */
    c->jit = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, NULL);
    if (!c->md || !c->mctx || !c->jit) {
        tok_rx_ctx_free(c);
        return fr_fail(FR_ENOMEM, "out of memory for regular expression state");
    }
    pcre2_jit_stack_assign(c->mctx, NULL, c->jit);
    return FR_OK;
}

void tok_rx_ctx_free(tok_rx_ctx *c)
{
    if (c->md) pcre2_match_data_free(c->md);
    if (c->mctx) pcre2_match_context_free(c->mctx);
    if (c->jit) pcre2_jit_stack_free(c->jit);
    memset(c, 0, sizeof *c);
}

int tok_segs_push(tok_segs *l, uint32_t s, uint32_t e, uint32_t match)
{
    tok_seg *v = fr_array_room(l->v, l->n, &l->cap, sizeof *v, 64);
    if (!v) return -1;
    l->v = v;
    l->v[l->n++] = (tok_seg){s, e, match};
    return 0;
}

/* Adds the non-match before a match (when not empty) and the match. */
static int push_match(tok_segs *l, size_t *prev, size_t s, size_t e)
{
    if (*prev != s && tok_segs_push(l, (uint32_t)*prev, (uint32_t)s, 0) != 0) return -1;
    if (tok_segs_push(l, (uint32_t)s, (uint32_t)e, 1) != 0) return -1;
    *prev = e;
    return 0;
}

fr_status tok_regex_matches(const tok_regex *re, tok_rx_ctx *c, const char *s, size_t n, tok_segs *l)
{
    l->n = 0;
    if (n == 0) return tok_segs_push(l, 0, 0, 0) ? fr_fail(FR_ENOMEM, "out of memory splitting text") : FR_OK;
    size_t prev = 0, from = 0, last_end = (size_t)-1;
    while (from <= n) {
        int rc = pcre2_match(re->code, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK, c->md, c->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return fr_fail(FR_EINTERNAL, "regular expression failed on %zu bytes of text: %s", n, (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        /* Oniguruma's iterator refuses an empty match right where the last
         * match ended, and steps one character instead. */
        if (ms == me && me == last_end) {
            from += from < n ? (size_t)tok_utf8_len((unsigned char)s[from]) : 1;
            continue;
        }
        from = me;
        last_end = me;
        if (push_match(l, &prev, ms, me) != 0) return fr_fail(FR_ENOMEM, "out of memory splitting text");
    }
    if (prev != n && tok_segs_push(l, (uint32_t)prev, (uint32_t)n, 0) != 0)
        return fr_fail(FR_ENOMEM, "out of memory splitting text");
    return FR_OK;
}

fr_status tok_char_matches(int (*pred)(uint32_t cp, uint32_t arg), uint32_t arg, const char *s, size_t n,
                           tok_segs *l)
{
    l->n = 0;
    if (n == 0) return tok_segs_push(l, 0, 0, 0) ? fr_fail(FR_ENOMEM, "out of memory splitting text") : FR_OK;
    size_t prev = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = tok_utf8_next(s + i, &cp);
        if (pred(cp, arg) && push_match(l, &prev, i, i + (size_t)k) != 0)
            return fr_fail(FR_ENOMEM, "out of memory splitting text");
        i += (size_t)k;
    }
    if (prev < n && tok_segs_push(l, (uint32_t)prev, (uint32_t)n, 0) != 0)
        return fr_fail(FR_ENOMEM, "out of memory splitting text");
    return FR_OK;
}

/* Extends the last kept piece to end at e, or starts one. */
static void extend_or_push(tok_segs *l, size_t *out, tok_seg s)
{
    if (*out) l->v[*out - 1].e = s.e;
    else l->v[(*out)++] = (tok_seg){s.s, s.e, 0};
}

void tok_segs_apply(tok_segs *l, tok_split_behavior b, int invert)
{
    if (invert)
        for (size_t i = 0; i < l->n; i++) l->v[i].match = !l->v[i].match;
    size_t out = 0;
    uint32_t prev_match = 0;
    switch (b) {
    case TOK_SPLIT_REMOVED:
        return;   /* matches are the dropped pieces already */
    case TOK_SPLIT_ISOLATED:
        for (size_t i = 0; i < l->n; i++) l->v[i].match = 0;
        return;
    case TOK_SPLIT_CONTIGUOUS:
        for (size_t i = 0; i < l->n; i++) {
            tok_seg s = l->v[i];
            if (s.match == prev_match) extend_or_push(l, &out, s);
            else l->v[out++] = (tok_seg){s.s, s.e, 0};
            prev_match = s.match;
        }
        break;
    case TOK_SPLIT_MERGED_PREV:
        for (size_t i = 0; i < l->n; i++) {
            tok_seg s = l->v[i];
            if (s.match && !prev_match) extend_or_push(l, &out, s);
            else l->v[out++] = (tok_seg){s.s, s.e, 0};
            prev_match = s.match;
        }
        break;
    case TOK_SPLIT_MERGED_NEXT:
        /* The same walk from the right end: a match joins the piece after
         * it. Pieces are written from the end of the array backwards. */
        out = l->n;
        for (size_t i = l->n; i-- > 0;) {
            tok_seg s = l->v[i];
            if (s.match && !prev_match && out < l->n) l->v[out].s = s.s;
            else l->v[--out] = (tok_seg){s.s, s.e, 0};
            prev_match = s.match;
        }
        memmove(l->v, l->v + out, (l->n - out) * sizeof *l->v);
        out = l->n - out;
        break;
    }
    l->n = out;
}
