/* tokenizer.json's "normalizer" and "pre_tokenizer", read into the flat
 * arrays the encoder runs. A type this library does not implement is
 * refused with its name and place ("pre_tokenizer.pretokenizers[1]: type
 * Whitespace is not supported"): encoding without it would give other ids. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

static fr_status get_prepend_scheme(const cJSON *j, const char *where, tok_prepend *out)
{
    const char *s = tok_json_str(j, "prepend_scheme");
    *out = TOK_PREPEND_ALWAYS;
    if (s && strcmp(s, "first") == 0) *out = TOK_PREPEND_FIRST;
    else if (s && strcmp(s, "never") == 0) *out = TOK_PREPEND_NEVER;
    else if (s && strcmp(s, "always") != 0) return fr_fail(FR_EFORMAT, "%s: unknown prepend_scheme \"%s\"", where, s);
    /* Files from before prepend_scheme say add_prefix_space instead. */
    const cJSON *aps = cJSON_GetObjectItemCaseSensitive(j, "add_prefix_space");
    if (cJSON_IsFalse(aps)) {
        if (s && *out != TOK_PREPEND_NEVER)
            return fr_fail(FR_EFORMAT, "%s: add_prefix_space false contradicts prepend_scheme \"%s\"", where, s);
        *out = TOK_PREPEND_NEVER;
    }
    return FR_OK;
}

/* ---- normalizers ---- */

static fr_status add_norm(fr_tokenizer *t, tok_norm z)
{
    tok_norm *v = realloc(t->norm, (t->n_norm + 1) * sizeof *v);
    if (!v) {
        tok_regex_free(&z.re);
        free(z.text);
        return fr_fail(FR_ENOMEM, "out of memory reading the normalizer");
    }
    t->norm = v;
    t->norm[t->n_norm++] = z;
    return FR_OK;
}

static fr_status parse_norm(fr_tokenizer *t, const cJSON *j, const char *where, int depth)
{
    const char *type = tok_json_str(j, "type");
    if (!type) return fr_fail(FR_EFORMAT, "%s: not an object with a \"type\"", where);
    static const char *const forms[] = {"NFC", "NFD", "NFKC", "NFKD"};
    for (int i = 0; i < 4; i++)
        if (strcmp(type, forms[i]) == 0) return add_norm(t, (tok_norm){.kind = (tok_norm_kind)(TOK_NORM_NFC + i)});
    if (strcmp(type, "Sequence") == 0) return tok_parse_sequence(t, j, "normalizers", where, depth, parse_norm);
    tok_norm z = {0};
    fr_status st = FR_OK;
    if (strcmp(type, "Prepend") == 0 || strcmp(type, "Replace") == 0) {
        const char *text = tok_json_str(j, type[0] == 'P' ? "prepend" : "content");
        if (!text) return fr_fail(FR_EFORMAT, "%s: %s without its string", where, type);
        z.kind = type[0] == 'P' ? TOK_NORM_PREPEND : TOK_NORM_REPLACE;
        if (z.kind == TOK_NORM_REPLACE && (st = tok_field_pattern(j, where, &z.re)) != FR_OK) return st;
        z.text = strdup(text);
        z.text_len = strlen(text);
        if (!z.text) { tok_regex_free(&z.re); return fr_fail(FR_ENOMEM, "out of memory reading the normalizer"); }
    } else if (strcmp(type, "Strip") == 0) {
        z.kind = TOK_NORM_STRIP;
        if ((st = tok_field_bool(j, "strip_left", 1, where, &z.left)) != FR_OK ||
            (st = tok_field_bool(j, "strip_right", 1, where, &z.right)) != FR_OK)
            return st;
    } else if (strcmp(type, "ByteLevel") == 0) {
        z.kind = TOK_NORM_BYTE_LEVEL;
    } else {
        return fr_fail(FR_EUNSUPPORTED, "%s: normalizer type %s is not supported (supported: NFC, NFD, NFKC, NFKD, "
                       "Prepend, Replace, Strip, ByteLevel, Sequence)", where, type);
    }
    return add_norm(t, z);
}

fr_status tok_parse_normalizer(fr_tokenizer *t, const cJSON *j)
{
    if (!j || cJSON_IsNull(j)) return FR_OK;
    return parse_norm(t, j, "normalizer", 0);
}

/* ---- pre-tokenizers ---- */

static fr_status add_pre(fr_tokenizer *t, tok_pre p)
{
    tok_pre *v = realloc(t->pre, (t->n_pre + 1) * sizeof *v);
    if (!v) {
        tok_regex_free(&p.re);
        return fr_fail(FR_ENOMEM, "out of memory reading the pre-tokenizer");
    }
    t->pre = v;
    t->pre[t->n_pre++] = p;
    return FR_OK;
}

static fr_status parse_behavior(const cJSON *j, const char *where, tok_split_behavior *out)
{
    static const char *const names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    const char *b = tok_json_str(j, "behavior");
    for (int i = 0; b && i < 5; i++)
        if (strcmp(b, names[i]) == 0) {
            *out = (tok_split_behavior)i;
            return FR_OK;
        }
    return fr_fail(FR_EFORMAT, "%s: \"behavior\" is not one of Removed, Isolated, MergedWithPrevious, "
                   "MergedWithNext, Contiguous", where);
}

/* GPT-2's pattern, which ByteLevel splits with when use_regex is on. */
static const char gpt2_pattern[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static fr_status parse_one_pre(const cJSON *j, const char *type, const char *where, tok_pre *p)
{
    fr_status st;
    if (strcmp(type, "Split") == 0) {
        p->kind = TOK_PRE_SPLIT;
        if ((st = parse_behavior(j, where, &p->behavior)) != FR_OK ||
            (st = tok_field_bool(j, "invert", 0, where, &p->invert)) != FR_OK)
            return st;
        return tok_field_pattern(j, where, &p->re);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        p->kind = TOK_PRE_BYTE_LEVEL;
        if ((st = tok_field_bool(j, "add_prefix_space", 1, where, &p->add_prefix_space)) != FR_OK ||
            (st = tok_field_bool(j, "use_regex", 1, where, &p->use_regex)) != FR_OK)
            return st;
        return p->use_regex ? tok_regex_compile(&p->re, gpt2_pattern, sizeof gpt2_pattern - 1, 0, where) : FR_OK;
    }
    if (strcmp(type, "Digits") == 0) {
        p->kind = TOK_PRE_DIGITS;
        return tok_field_bool(j, "individual_digits", 0, where, &p->individual);
    }
    if (strcmp(type, "Metaspace") == 0) {
        p->kind = TOK_PRE_METASPACE;
        if ((st = tok_field_char(j, "replacement", where, &p->ch)) != FR_OK ||
            (st = get_prepend_scheme(j, where, &p->prepend)) != FR_OK)
            return st;
        return tok_field_bool(j, "split", 1, where, &p->split);
    }
    if (strcmp(type, "WhitespaceSplit") == 0) {
        p->kind = TOK_PRE_WHITESPACE_SPLIT;
        return FR_OK;
    }
    if (strcmp(type, "CharDelimiterSplit") == 0) {
        p->kind = TOK_PRE_CHAR_SPLIT;
        return tok_field_char(j, "delimiter", where, &p->ch);
    }
    return fr_fail(FR_EUNSUPPORTED, "%s: pre-tokenizer type %s is not supported (supported: Split, ByteLevel, "
                   "Digits, Metaspace, WhitespaceSplit, CharDelimiterSplit, Sequence)", where, type);
}

static fr_status parse_pre(fr_tokenizer *t, const cJSON *j, const char *where, int depth)
{
    const char *type = tok_json_str(j, "type");
    if (!type) return fr_fail(FR_EFORMAT, "%s: not an object with a \"type\"", where);
    if (strcmp(type, "Sequence") == 0) return tok_parse_sequence(t, j, "pretokenizers", where, depth, parse_pre);
    tok_pre p = {0};
    fr_status st = parse_one_pre(j, type, where, &p);
    if (st != FR_OK) {
        tok_regex_free(&p.re);
        return st;
    }
    return add_pre(t, p);
}

fr_status tok_parse_pre_tokenizer(fr_tokenizer *t, const cJSON *j)
{
    if (!j || cJSON_IsNull(j)) return FR_OK;
    fr_status st = parse_pre(t, j, "pre_tokenizer", 0);
    if (st != FR_OK) return st;
    t->mapped_out = t->n_pre > 0 && t->pre[t->n_pre - 1].kind == TOK_PRE_BYTE_LEVEL;
    return FR_OK;
}
