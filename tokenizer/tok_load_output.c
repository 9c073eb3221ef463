/* tokenizer.json's "decoder" and "post_processor". Decoders become a flat
 * array run in order; every post-processor that adds tokens is folded into
 * one template of the single-sequence case (ids around TOK_TMPL_SEQ), so
 * encoding with special tokens is one copy. Types this library does not
 * implement are refused by name. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* ---- decoders ---- */

static fr_status add_dec(fr_tokenizer *t, tok_dec d)
{
    tok_dec *v = realloc(t->dec, (t->n_dec + 1) * sizeof *v);
    if (!v) {
        tok_regex_free(&d.re);
        free(d.text);
        return fr_fail(FR_ENOMEM, "out of memory reading the decoder");
    }
    t->dec = v;
    t->dec[t->n_dec++] = d;
    return FR_OK;
}

static fr_status count_field(const cJSON *j, const char *key, const char *where, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 1e6 || v->valuedouble != (int)v->valuedouble)
        return fr_fail(FR_EFORMAT, "%s: \"%s\" is not a count", where, key);
    *out = (int)v->valuedouble;
    return FR_OK;
}

static fr_status parse_one_dec(const cJSON *j, const char *type, const char *where, tok_dec *d)
{
    fr_status st;
    if (strcmp(type, "ByteLevel") == 0) { d->kind = TOK_DEC_BYTE_LEVEL; return FR_OK; }
    if (strcmp(type, "ByteFallback") == 0) { d->kind = TOK_DEC_BYTE_FALLBACK; return FR_OK; }
    if (strcmp(type, "Fuse") == 0) { d->kind = TOK_DEC_FUSE; return FR_OK; }
    if (strcmp(type, "Strip") == 0) {
        d->kind = TOK_DEC_STRIP;
        if ((st = tok_field_char(j, "content", where, &d->ch)) != FR_OK ||
            (st = count_field(j, "start", where, &d->start)) != FR_OK)
            return st;
        return count_field(j, "stop", where, &d->stop);
    }
    if (strcmp(type, "Replace") == 0 || strcmp(type, "BPEDecoder") == 0) {
        int bpe = type[0] == 'B';
        const char *text = tok_json_str(j, bpe ? "suffix" : "content");
        if (bpe && !text) text = "</w>";
        if (!text) return fr_fail(FR_EFORMAT, "%s: Replace without \"content\"", where);
        d->kind = bpe ? TOK_DEC_BPE : TOK_DEC_REPLACE;
        d->text = strdup(text);
        d->text_len = strlen(text);
        if (!d->text) return fr_fail(FR_ENOMEM, "out of memory reading the decoder");
        if (bpe) return FR_OK;
        return tok_field_pattern(j, where, &d->re);
    }
    if (strcmp(type, "Metaspace") == 0) {
        d->kind = TOK_DEC_METASPACE;
        if ((st = tok_field_char(j, "replacement", where, &d->ch)) != FR_OK) return st;
        const char *s = tok_json_str(j, "prepend_scheme");
        d->prepend = s && strcmp(s, "never") == 0 ? TOK_PREPEND_NEVER : TOK_PREPEND_ALWAYS;
        if (cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(j, "add_prefix_space"))) d->prepend = TOK_PREPEND_NEVER;
        return FR_OK;
    }
    return fr_fail(FR_EUNSUPPORTED, "%s: decoder type %s is not supported (supported: ByteLevel, ByteFallback, Fuse, "
                   "Strip, Replace, Metaspace, BPEDecoder, Sequence)", where, type);
}

static fr_status parse_dec(fr_tokenizer *t, const cJSON *j, const char *where, int depth)
{
    const char *type = tok_json_str(j, "type");
    if (!type) return fr_fail(FR_EFORMAT, "%s: not an object with a \"type\"", where);
    if (strcmp(type, "Sequence") == 0) return tok_parse_sequence(t, j, "decoders", where, depth, parse_dec);
    tok_dec d = {0};
    fr_status st = parse_one_dec(j, type, where, &d);
    if (st != FR_OK) {
        tok_regex_free(&d.re);
        free(d.text);
        return st;
    }
    return add_dec(t, d);
}

fr_status tok_parse_decoder(fr_tokenizer *t, const cJSON *j)
{
    if (!j || cJSON_IsNull(j)) return FR_OK;
    t->has_decoder = 1;
    return parse_dec(t, j, "decoder", 0);
}

/* ---- post-processors ---- */

/* Replaces the sequence slot of t's template by the current template:
 * applying `outer` after what t already holds. outer: n ids around one
 * TOK_TMPL_SEQ. */
static fr_status wrap(fr_tokenizer *t, const int *outer, size_t n)
{
    size_t total = n - 1 + t->n_tmpl;
    int *v = malloc(total * sizeof *v), k = 0;
    if (!v) return fr_fail(FR_ENOMEM, "out of memory reading the post-processor");
    for (size_t i = 0; i < n; i++) {
        if (outer[i] != TOK_TMPL_SEQ) { v[k++] = outer[i]; continue; }
        memcpy(v + k, t->tmpl, t->n_tmpl * sizeof *v);
        k += (int)t->n_tmpl;
    }
    free(t->tmpl);
    t->tmpl = v;
    t->n_tmpl = total;
    t->has_tmpl = 1;
    return FR_OK;
}

/* A ["token", id] pair of RobertaProcessing and BertProcessing. */
static fr_status token_pair(const cJSON *j, const char *key, const char *where, int *id)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != 2 || !cJSON_IsNumber(v->child->next) ||
        v->child->next->valuedouble < 0)
        return fr_fail(FR_EFORMAT, "%s: \"%s\" is not a [token, id] pair", where, key);
    *id = (int)v->child->next->valuedouble;
    return FR_OK;
}

/* TemplateProcessing's single template, with the ids of its special tokens. */
static fr_status template_single(fr_tokenizer *t, const cJSON *j, const char *where)
{
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(j, "single");
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(j, "special_tokens");
    if (!cJSON_IsArray(single)) return fr_fail(FR_EFORMAT, "%s: \"single\" is not a list", where);
    fr_buf ids = {0};
    int seq = 0;
    for (const cJSON *p = single->child; p; p = p->next) {
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(p, "SpecialToken");
        const cJSON *sq = cJSON_GetObjectItemCaseSensitive(p, "Sequence");
        const char *name = tok_json_str(sp, "id");
        if (sq) {
            const char *which = tok_json_str(sq, "id");
            if (!which || strcmp(which, "A") != 0) {
                fr_buf_free(&ids);
                return fr_fail(FR_EUNSUPPORTED, "%s: a single template may only hold sequence A", where);
            }
            int v = TOK_TMPL_SEQ;
            fr_buf_put(&ids, &v, sizeof v);
            seq++;
            continue;
        }
        const cJSON *entry = name ? cJSON_GetObjectItemCaseSensitive(specials, name) : NULL;
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(entry, "ids");
        if (!cJSON_IsArray(list)) {
            fr_buf_free(&ids);
            return fr_fail(FR_EFORMAT, "%s: template piece %s has no ids in \"special_tokens\"", where,
                           name ? name : "(neither SpecialToken nor Sequence)");
        }
        for (const cJSON *x = list->child; x; x = x->next) {
            int v = cJSON_IsNumber(x) && x->valuedouble >= 0 ? (int)x->valuedouble : -2;
            fr_buf_put(&ids, &v, sizeof v);
        }
    }
    fr_status st = FR_OK;
    if (seq != 1) st = fr_fail(FR_EUNSUPPORTED, "%s: the single template holds sequence A %d times", where, seq);
    else if (ids.failed) st = fr_fail(FR_ENOMEM, "out of memory reading the post-processor");
    else {
        for (size_t i = 0; i < ids.len / sizeof(int); i++)
            if (((int *)ids.data)[i] == -2) st = fr_fail(FR_EFORMAT, "%s: a special token id is not an id", where);
        if (st == FR_OK) st = wrap(t, (const int *)ids.data, ids.len / sizeof(int));
    }
    fr_buf_free(&ids);
    return st;
}

static fr_status parse_post(fr_tokenizer *t, const cJSON *j, const char *where, int depth)
{
    const char *type = tok_json_str(j, "type");
    if (!type) return fr_fail(FR_EFORMAT, "%s: not an object with a \"type\"", where);
    if (strcmp(type, "ByteLevel") == 0) return FR_OK;   /* it only trims offsets */
    if (strcmp(type, "TemplateProcessing") == 0) return template_single(t, j, where);
    if (strcmp(type, "RobertaProcessing") == 0 || strcmp(type, "BertProcessing") == 0) {
        int cls, sep;
        fr_status st = token_pair(j, "cls", where, &cls);
        if (st == FR_OK) st = token_pair(j, "sep", where, &sep);
        if (st != FR_OK) return st;
        int outer[3] = {cls, TOK_TMPL_SEQ, sep};
        return wrap(t, outer, 3);
    }
    if (strcmp(type, "Sequence") == 0) return tok_parse_sequence(t, j, "processors", where, depth, parse_post);
    return fr_fail(FR_EUNSUPPORTED, "%s: post-processor type %s is not supported (supported: TemplateProcessing, "
                   "ByteLevel, RobertaProcessing, BertProcessing, Sequence)", where, type);
}

fr_status tok_parse_post_processor(fr_tokenizer *t, const cJSON *j)
{
    t->tmpl = malloc(sizeof *t->tmpl);
    if (!t->tmpl) return fr_fail(FR_ENOMEM, "out of memory reading the post-processor");
    t->tmpl[0] = TOK_TMPL_SEQ;
    t->n_tmpl = 1;
    if (!j || cJSON_IsNull(j)) return FR_OK;
    return parse_post(t, j, "post_processor", 0);
}
