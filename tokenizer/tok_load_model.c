/* tokenizer.json's "model": a BPE vocabulary and its merges, checked as
 * tokenizers' BpeBuilder checks them (every merge's tokens and result in
 * the vocabulary), and the lookup tables the encoder runs on. Other model
 * types are refused by name. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

enum { MAX_ID = 1 << 24 };

/* A bool field that may be absent or null (then 0). */
static fr_status opt_bool(const cJSON *m, const char *key, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(m, key);
    *out = 0;
    if (!v || cJSON_IsNull(v)) return FR_OK;
    if (!cJSON_IsBool(v)) return fr_fail(FR_EFORMAT, "model: \"%s\" is not a boolean", key);
    *out = cJSON_IsTrue(v);
    return FR_OK;
}

/* A string field that may be absent or null (then NULL); "" counts as
 * absent, which is how tokenizers' BPE behaves with an empty prefix. */
static fr_status opt_str(const cJSON *m, const char *key, char **out, size_t *len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(m, key);
    *out = NULL;
    *len = 0;
    if (!v || cJSON_IsNull(v)) return FR_OK;
    if (!cJSON_IsString(v)) return fr_fail(FR_EFORMAT, "model: \"%s\" is not a string", key);
    if (!*v->valuestring) return FR_OK;
    *out = strdup(v->valuestring);
    *len = strlen(v->valuestring);
    return *out ? FR_OK : fr_fail(FR_ENOMEM, "out of memory reading the model");
}

/* The byte of a "<0xNN>" token as tokenizers spells it (upper-case hex), or -1. */
static int fallback_byte(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        if (c >= '0' && c <= '9') v = 16 * v + (c - '0');
        else if (c >= 'A' && c <= 'F') v = 16 * v + (c - 'A' + 10);
        else return -1;
    }
    return v;
}

static fr_status parse_vocab(fr_tokenizer *t, const cJSON *vocab)
{
    tok_bpe *m = &t->bpe;
    if (!cJSON_IsObject(vocab)) return fr_fail(FR_EFORMAT, "model: \"vocab\" is not an object of token: id");
    if (tok_strmap_init(&m->vocab, (size_t)cJSON_GetArraySize(vocab)) != 0)
        return fr_fail(FR_ENOMEM, "out of memory for the vocabulary");
    for (const cJSON *e = vocab->child; e; e = e->next) {
        double d = e->valuedouble;
        if (!cJSON_IsNumber(e) || d < 0 || d >= MAX_ID || d != floor(d))
            return fr_fail(FR_EFORMAT, "model: vocab[\"%s\"] is not an id from 0 to %d", e->string, MAX_ID - 1);
        int id = (int)d;
        size_t len = strlen(e->string);
        uint32_t off = tok_str_add(t, e->string, len);
        if (off == UINT32_MAX || tok_strmap_put(&m->vocab, t->str.data, off, (uint32_t)len, id) != 0 ||
            tok_set_id(t, id, off, (uint32_t)len) != 0)
            return fr_fail(FR_ENOMEM, "out of memory for the vocabulary");
        uint32_t cp;
        if (len && (size_t)tok_utf8_next(e->string, &cp) == len && cp < 0x800) m->char_id[cp] = id;
        int b = fallback_byte(e->string, len);
        if (b >= 0) m->fallback_id[b] = id;
    }
    m->n_vocab = m->vocab.count;
    return FR_OK;
}

/* The two tokens of merge i: "a b" (one space) or ["a", "b"]. */
static fr_status merge_parts(const cJSON *e, size_t i, const char **a, size_t *al, const char **b,
                             size_t *bl)
{
    if (cJSON_IsString(e)) {
        const char *s = e->valuestring, *sp = strchr(s, ' ');
        if (!sp || strchr(sp + 1, ' '))
            return fr_fail(FR_EFORMAT, "model: merges[%zu] \"%s\" is not two tokens separated by one space", i, s);
        *a = s;
        *al = (size_t)(sp - s);
        *b = sp + 1;
        *bl = strlen(sp + 1);
    } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
               cJSON_IsString(e->child->next)) {
        *a = e->child->valuestring;
        *al = strlen(*a);
        *b = e->child->next->valuestring;
        *bl = strlen(*b);
    } else {
        return fr_fail(FR_EFORMAT, "model: merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", i);
    }
    return FR_OK;
}

static fr_status parse_merges(fr_tokenizer *t, const cJSON *merges)
{
    tok_bpe *m = &t->bpe;
    if (!cJSON_IsArray(merges)) return fr_fail(FR_EFORMAT, "model: \"merges\" is not a list");
    if (tok_pairmap_init(&m->merges, (size_t)cJSON_GetArraySize(merges)) != 0)
        return fr_fail(FR_ENOMEM, "out of memory for the merges");
    fr_buf cat = {0};
    fr_status st = FR_OK;
    size_t i = 0;
    for (const cJSON *e = merges->child; e && st == FR_OK; e = e->next, i++) {
        const char *a = NULL, *b = NULL;
        size_t al = 0, bl = 0;
        if ((st = merge_parts(e, i, &a, &al, &b, &bl)) != FR_OK) break;
        int32_t ida = tok_strmap_get(&m->vocab, t->str.data, a, al), idb = tok_strmap_get(&m->vocab, t->str.data, b, bl);
        if (ida < 0 || idb < 0) {
            st = fr_fail(FR_EFORMAT, "model: merges[%zu]: token \"%.*s\" is not in the vocabulary", i,
                         (int)(ida < 0 ? al : bl), ida < 0 ? a : b);
            break;
        }
        if (bl < m->prefix_len) {
            st = fr_fail(FR_EFORMAT, "model: merges[%zu]: \"%.*s\" is shorter than the subword prefix", i, (int)bl, b);
            break;
        }
        /* The merged token drops the right part's continuing-subword prefix. */
        cat.len = 0;
        fr_buf_put(&cat, a, al);
        fr_buf_put(&cat, b + m->prefix_len, bl - m->prefix_len);
        int32_t idn = cat.failed ? -1 : tok_strmap_get(&m->vocab, t->str.data, cat.data, cat.len);
        if (cat.failed) st = fr_fail(FR_ENOMEM, "out of memory for the merges");
        else if (idn < 0)
            st = fr_fail(FR_EFORMAT, "model: merges[%zu]: the merged token \"%s\" is not in the vocabulary", i, cat.data);
        else if (tok_pairmap_put(&m->merges, tok_pair_key(ida, idb), (uint32_t)i, idn) != 0)
            st = fr_fail(FR_ENOMEM, "out of memory for the merges");
    }
    fr_buf_free(&cat);
    return st;
}

/* Refuses what the model may hold but this library does not do. */
static fr_status check_type(const cJSON *j)
{
    if (!cJSON_IsObject(j)) return fr_fail(FR_EFORMAT, "\"model\" is missing or not an object");
    const char *type = tok_json_str(j, "type");
    if (type && strcmp(type, "BPE") != 0)
        return fr_fail(FR_EUNSUPPORTED, "model type %s is not supported (only BPE models are: byte-level BPE and "
                       "SentencePiece-style BPE)", type);
    if (!type && !cJSON_GetObjectItemCaseSensitive(j, "merges"))
        return fr_fail(FR_EUNSUPPORTED, "a model without a type and without merges (WordPiece, WordLevel or "
                       "Unigram) is not supported: only BPE models are");
    const cJSON *drop = cJSON_GetObjectItemCaseSensitive(j, "dropout");
    if (drop && !cJSON_IsNull(drop) && (!cJSON_IsNumber(drop) || drop->valuedouble != 0))
        return fr_fail(FR_EUNSUPPORTED, "model: BPE dropout is not supported (it makes encoding random)");
    return FR_OK;
}

fr_status tok_parse_model(fr_tokenizer *t, const cJSON *j)
{
    fr_status st = check_type(j);
    if (st != FR_OK) return st;
    tok_bpe *m = &t->bpe;
    for (int i = 0; i < 0x800; i++) m->char_id[i] = -1;
    for (int i = 0; i < 256; i++) m->fallback_id[i] = m->byte_id[i] = -1;
    char *unk = NULL;
    size_t unk_len;
    if ((st = opt_bool(j, "byte_fallback", &m->byte_fallback)) != FR_OK ||
        (st = opt_bool(j, "fuse_unk", &m->fuse_unk)) != FR_OK ||
        (st = opt_bool(j, "ignore_merges", &m->ignore_merges)) != FR_OK ||
        (st = opt_str(j, "continuing_subword_prefix", &m->prefix, &m->prefix_len)) != FR_OK ||
        (st = opt_str(j, "end_of_word_suffix", &m->suffix, &m->suffix_len)) != FR_OK ||
        (st = opt_str(j, "unk_token", &unk, &unk_len)) != FR_OK)
        return st;
    st = parse_vocab(t, cJSON_GetObjectItemCaseSensitive(j, "vocab"));
    if (st == FR_OK) st = parse_merges(t, cJSON_GetObjectItemCaseSensitive(j, "merges"));
    m->unk_id = -1;
    if (st == FR_OK && unk) {
        m->unk_id = tok_strmap_get(&m->vocab, t->str.data, unk, unk_len);
        if (m->unk_id < 0) st = fr_fail(FR_EFORMAT, "model: unk_token \"%s\" is not in the vocabulary", unk);
    }
    free(unk);
    if (st != FR_OK) return st;
    m->bytes_ok = !m->prefix && !m->suffix;
    for (int b = 0; b < 256; b++) {
        m->byte_id[b] = m->char_id[tok_byte_char((unsigned char)b)];
        m->bytes_ok &= m->byte_id[b] >= 0;
    }
    return FR_OK;
}
