/* Pre-tokenizers, run depth first: stage k splits (and maybe rewrites) its
 * piece and hands each sub-piece to stage k + 1 before it looks at the next
 * one; after the last stage a piece goes to the BPE model. The ids come out
 * in text order, as tokenizers' stage-by-stage passes over the whole list
 * give them, without a list of every piece of the text in memory. Each
 * stage keeps its own scratch (ws->stages[k]), alive until its sub-pieces
 * are done.
 *
 * When ByteLevel is the last stage its pieces reach the model still as raw
 * bytes: the model reads them through the byte table itself, so the
 * byte-level spelling is never written out (tok_bpe.c). */
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

static fr_status next(const fr_tokenizer *t, tok_ws *ws, size_t k, const char *s, size_t n, int at_start)
{
    if (!n) return FR_OK;   /* tokenizers drops empty pieces */
    if (k + 1 < t->n_pre) return tok_pretok_run(t, ws, k + 1, s, n, at_start);
    return tok_bpe_word(t, ws, s, n, t->mapped_out);
}

/* Hands the kept pieces of a (processed) match list over s to the next stage. */
static fr_status emit(const fr_tokenizer *t, tok_ws *ws, size_t k, const char *s, const tok_segs *l, int at_start)
{
    for (size_t i = 0; i < l->n; i++) {
        if (l->v[i].match) continue;
        fr_status st = next(t, ws, k, s + l->v[i].s, l->v[i].e - l->v[i].s, at_start && l->v[i].s == 0);
        if (st != FR_OK) return st;
    }
    return FR_OK;
}

static int pred_numeric(uint32_t cp, uint32_t arg) { (void)arg; return tok_is_numeric(cp); }
static int pred_space(uint32_t cp, uint32_t arg) { (void)arg; return tok_is_whitespace(cp); }
static int pred_char(uint32_t cp, uint32_t arg) { return cp == arg; }

static fr_status oom(tok_stage *st)
{
    st->a.failed = st->b.failed = 0;
    return fr_fail(FR_ENOMEM, "out of memory pre-tokenizing text");
}

/* One ByteLevel piece onwards: mapped to its byte-level spelling, unless
 * the model does that itself. */
static fr_status byte_level_piece(const fr_tokenizer *t, tok_ws *ws, size_t k, const char *s, size_t n, int at_start)
{
    if (k + 1 == t->n_pre && t->mapped_out) return next(t, ws, k, s, n, at_start);
    tok_stage *st = &ws->stages[k];
    st->b.len = 0;
    tok_bytelevel_map(&st->b, s, n);
    if (st->b.failed) return oom(st);
    return next(t, ws, k, st->b.data, st->b.len, at_start);
}

static fr_status byte_level(const fr_tokenizer *t, tok_ws *ws, size_t k, const char *s, size_t n, int at_start)
{
    const tok_pre *p = &t->pre[k];
    tok_stage *st = &ws->stages[k];
    if (p->add_prefix_space && s[0] != ' ') {
        st->a.len = 0;
        fr_buf_put(&st->a, " ", 1);
        fr_buf_put(&st->a, s, n);
        if (st->a.failed) return oom(st);
        s = st->a.data;
        n = st->a.len;
    }
    if (!p->use_regex) return byte_level_piece(t, ws, k, s, n, at_start);
    fr_status rc = tok_regex_matches(&p->re, &ws->rx, s, n, &st->segs);
    if (rc != FR_OK) return rc;
    for (size_t i = 0; i < st->segs.n; i++) {
        tok_seg g = st->segs.v[i];
        if (g.e == g.s) continue;
        rc = byte_level_piece(t, ws, k, s + g.s, g.e - g.s, at_start && g.s == 0);
        if (rc != FR_OK) return rc;
    }
    return FR_OK;
}

static fr_status metaspace(const fr_tokenizer *t, tok_ws *ws, size_t k, const char *s, size_t n, int at_start)
{
    const tok_pre *p = &t->pre[k];
    tok_stage *st = &ws->stages[k];
    char rep[4];
    int rl = tok_utf8_put(p->ch, rep);
    /* Spaces become the replacement first; the prepend test looks at the result. */
    st->a.len = 0;
    size_t from = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] == ' ') {
            fr_buf_put(&st->a, s + from, i - from);
            fr_buf_put(&st->a, rep, (size_t)rl);
            from = i + 1;
        }
    fr_buf_put(&st->a, s + from, n - from);
    int starts = st->a.len >= (size_t)rl && memcmp(st->a.data, rep, (size_t)rl) == 0;
    int prepend = !starts && (p->prepend == TOK_PREPEND_ALWAYS || (p->prepend == TOK_PREPEND_FIRST && at_start));
    st->b.len = 0;
    if (prepend) fr_buf_put(&st->b, rep, (size_t)rl);
    fr_buf_put(&st->b, st->a.data, st->a.len);
    if (st->a.failed || st->b.failed) return oom(st);
    if (!p->split) return next(t, ws, k, st->b.data, st->b.len, at_start);
    fr_status rc = tok_char_matches(pred_char, p->ch, st->b.data, st->b.len, &st->segs);
    if (rc != FR_OK) return rc;
    tok_segs_apply(&st->segs, TOK_SPLIT_MERGED_NEXT, 0);
    return emit(t, ws, k, st->b.data, &st->segs, at_start);
}

fr_status tok_pretok_run(const fr_tokenizer *t, tok_ws *ws, size_t k, const char *s, size_t n, int at_start)
{
    if (k >= t->n_pre) return tok_bpe_word(t, ws, s, n, t->mapped_out);
    if (!n) return FR_OK;
    const tok_pre *p = &t->pre[k];
    tok_stage *st = &ws->stages[k];
    fr_status rc;
    switch (p->kind) {
    case TOK_PRE_SPLIT:
        rc = tok_regex_matches(&p->re, &ws->rx, s, n, &st->segs);
        if (rc != FR_OK) return rc;
        tok_segs_apply(&st->segs, p->behavior, p->invert);
        return emit(t, ws, k, s, &st->segs, at_start);
    case TOK_PRE_BYTE_LEVEL:
        return byte_level(t, ws, k, s, n, at_start);
    case TOK_PRE_DIGITS:
        rc = tok_char_matches(pred_numeric, 0, s, n, &st->segs);
        if (rc != FR_OK) return rc;
        tok_segs_apply(&st->segs, p->individual ? TOK_SPLIT_ISOLATED : TOK_SPLIT_CONTIGUOUS, 0);
        return emit(t, ws, k, s, &st->segs, at_start);
    case TOK_PRE_METASPACE:
        return metaspace(t, ws, k, s, n, at_start);
    case TOK_PRE_WHITESPACE_SPLIT:
    case TOK_PRE_CHAR_SPLIT:
        rc = p->kind == TOK_PRE_CHAR_SPLIT ? tok_char_matches(pred_char, p->ch, s, n, &st->segs)
                                           : tok_char_matches(pred_space, 0, s, n, &st->segs);
        if (rc != FR_OK) return rc;
        tok_segs_apply(&st->segs, TOK_SPLIT_REMOVED, 0);
        return emit(t, ws, k, s, &st->segs, at_start);
    }
    return fr_fail(FR_EINTERNAL, "pre-tokenizer %d has no implementation", (int)p->kind);
}
