/* Loading a tokenizer: the file or folder, the top level of tokenizer.json
 * (each component is read by its own file), the id tables, and freeing.
 * The lookups on a loaded tokenizer live here too. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tok_internal.h"
#include "tok_utf8.h"

const char *tok_json_str(const cJSON *o, const char *key)
{
    const cJSON *v = o ? cJSON_GetObjectItemCaseSensitive(o, key) : NULL;
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

uint32_t tok_str_add(fr_tokenizer *t, const char *s, size_t len)
{
    size_t off = t->str.len;
    if (off + len >= UINT32_MAX) return UINT32_MAX;
    fr_buf_put(&t->str, s, len);
    return t->str.failed ? UINT32_MAX : (uint32_t)off;
}

int tok_set_id(fr_tokenizer *t, int id, uint32_t off, uint32_t len)
{
    if ((size_t)id >= t->cap_ids) {
        size_t cap = t->cap_ids ? t->cap_ids : 1024;
        while (cap <= (size_t)id) cap *= 2;
        uint32_t *o = realloc(t->id_off, cap * sizeof *o);
        if (o) t->id_off = o;
        uint32_t *l = realloc(t->id_len, cap * sizeof *l);
        if (l) t->id_len = l;
        int32_t *a = realloc(t->id_added, cap * sizeof *a);
        if (a) t->id_added = a;
        if (!o || !l || !a) return -1;
        for (size_t i = t->cap_ids; i < cap; i++) {
            t->id_off[i] = 0;
            t->id_len[i] = UINT32_MAX;
            t->id_added[i] = -1;
        }
        t->cap_ids = cap;
    }
    if (id >= t->n_ids) t->n_ids = id + 1;
    if (off != UINT32_MAX) {
        t->id_off[id] = off;
        t->id_len[id] = len;
    }
    return 0;
}

/* Marks id as special when the string decoding gives it is a special
 * token's content (tokenizers' test). */
static void mark_if_special(fr_tokenizer *t, const tok_strmap *specials, int id)
{
    size_t len;
    const char *s = fr_tokenizer_id_token(t, id, &len);
    if (s && tok_strmap_get(specials, t->str.data, s, len) >= 0) t->id_special[id] = 1;
}

/* What skip_special drops. Only two kinds of id can decode to a special
 * token's content: added tokens, and vocabulary entries spelled like one;
 * looking at those alone keeps this off the vocabulary's size. */
static fr_status mark_special(fr_tokenizer *t)
{
    t->id_special = calloc(t->n_ids ? (size_t)t->n_ids : 1, 1);
    tok_strmap specials;
    if (!t->id_special || tok_strmap_init(&specials, t->n_added) != 0) return fr_fail(FR_ENOMEM, "out of memory");
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].special && tok_strmap_put(&specials, t->str.data, t->added[i].off, t->added[i].len, 1) != 0) {
            tok_strmap_free(&specials);
            return fr_fail(FR_ENOMEM, "out of memory");
        }
    for (size_t i = 0; i < t->n_added; i++) {
        mark_if_special(t, &specials, t->added[i].id);
        int v = tok_strmap_get(&t->bpe.vocab, t->str.data, t->str.data + t->added[i].off, t->added[i].len);
        if (v >= 0 && t->added[i].special) mark_if_special(t, &specials, v);
    }
    tok_strmap_free(&specials);
    return FR_OK;
}

/* The post-processor's ids must be the tokenizer's own: a template naming
 * an id no token has would hand the engine ids outside the vocabulary
 * (known only once the added tokens are read). */
static fr_status check_template(const fr_tokenizer *t)
{
    for (size_t i = 0; i < t->n_tmpl; i++)
        if (t->tmpl[i] != TOK_TMPL_SEQ && (t->tmpl[i] < 0 || t->tmpl[i] >= t->n_ids))
            return fr_fail(FR_EFORMAT, "post_processor: its template adds id %d, and the vocabulary holds %d ids",
                           t->tmpl[i], t->n_ids);
    return FR_OK;
}

/* Refuses the top-level settings this library does not apply. */
static fr_status check_top(const cJSON *root)
{
    if (!cJSON_IsObject(root)) return fr_fail(FR_EFORMAT, "not a JSON object");
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "version");
    if (v && (!cJSON_IsString(v) || strcmp(v->valuestring, "1.0") != 0))
        return fr_fail(FR_EUNSUPPORTED, "tokenizer.json version %s is not supported (only \"1.0\")",
                       cJSON_IsString(v) ? v->valuestring : "(not a string)");
    static const char *const off[] = {"truncation", "padding"};
    for (int i = 0; i < 2; i++) {
        v = cJSON_GetObjectItemCaseSensitive(root, off[i]);
        if (v && !cJSON_IsNull(v))
            return fr_fail(FR_EUNSUPPORTED, "%s is set: this library encodes whole texts (set \"%s\": null)", off[i],
                           off[i]);
    }
    return FR_OK;
}

static fr_status build(fr_tokenizer *t, const cJSON *root)
{
    fr_status st = check_top(root);
    if (st == FR_OK) st = tok_parse_model(t, cJSON_GetObjectItemCaseSensitive(root, "model"));
    if (st == FR_OK) st = tok_parse_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"));
    if (st == FR_OK) st = tok_parse_pre_tokenizer(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"));
    if (st == FR_OK) st = tok_parse_decoder(t, cJSON_GetObjectItemCaseSensitive(root, "decoder"));
    if (st == FR_OK) st = tok_parse_post_processor(t, cJSON_GetObjectItemCaseSensitive(root, "post_processor"));
    if (st == FR_OK) st = tok_parse_added(t, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"));
    if (st == FR_OK) st = check_template(t);
    if (st == FR_OK) st = tok_build_tries(t);
    if (st == FR_OK) st = mark_special(t);
    return st;
}

fr_status fr_tokenizer_from_json(const char *json, size_t len, const char *config, size_t config_len,
                                 const char *label, fr_tokenizer **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_tokenizer_from_json: no place for the result");
    *out = NULL;
    if (!json) return fr_fail(FR_EINVAL, "fr_tokenizer_from_json: no text");
    if (!label) label = "tokenizer.json";
    fr_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return fr_fail(FR_ENOMEM, "out of memory for a tokenizer");
    pthread_mutex_init(&t->pool_lock, NULL);
    t->bos_id = t->eos_id = -1;
    fr_status st;
    /* JSON is UTF-8 (RFC 8259) and Hugging Face's loader refuses anything
     * else; cJSON does not check, and an invalid byte in a token would come
     * back out of decode. */
    size_t valid = tok_utf8_valid_prefix(json, len);
    cJSON *root = valid == len ? cJSON_ParseWithLength(json, len) : NULL;
    if (valid != len) {
        st = fr_fail(FR_EFORMAT, "%s: not UTF-8 (byte %zu)", label, valid);
    } else if (!root) {
        st = fr_fail(FR_EFORMAT, "%s: not valid JSON (near byte %zu)", label,
                     cJSON_GetErrorPtr() ? (size_t)(cJSON_GetErrorPtr() - json) : (size_t)0);
    } else {
        st = build(t, root);
        cJSON_Delete(root);
        if (st != FR_OK) st = fr_fail(st, "%s: %s", label, fr_last_error());
    }
    if (st == FR_OK && config) st = tok_apply_config(t, config, config_len, label);
    if (st != FR_OK) {
        fr_tokenizer_free(&t);
        return st;
    }
    *out = t;
    return FR_OK;
}

/* The whole file at path, malloc'd and NUL-terminated; NULL when it cannot
 * be read (*missing: it does not exist). */
static char *read_all(const char *path, size_t *len, int *missing)
{
    *missing = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        *missing = errno == ENOENT;
        fr_fail(FR_EIO, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    fr_buf b = {0};
    char chunk[1 << 16];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) fr_buf_put(&b, chunk, n);
    int bad = ferror(f) || b.failed;
    fclose(f);
    if (bad) {
        fr_buf_free(&b);
        fr_fail(FR_EIO, "cannot read %s", path);
        return NULL;
    }
    if (!b.data) fr_buf_put(&b, "", 0);
    *len = b.len;
    return b.data;
}

fr_status fr_tokenizer_load_opts(const char *path, unsigned flags, fr_tokenizer **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_tokenizer_load: no place for the result");
    *out = NULL;
    if (!path || !*path) return fr_fail(FR_EINVAL, "fr_tokenizer_load: no path");
    char file[4096], dir[4096];
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        snprintf(dir, sizeof dir, "%s", path);
        snprintf(file, sizeof file, "%s/tokenizer.json", path);
    } else {
        snprintf(file, sizeof file, "%s", path);
        const char *slash = strrchr(path, '/');
        snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    }
    size_t len, config_len = 0;
    int missing;
    char *json = read_all(file, &len, &missing);
    if (!json) return FR_EIO;
    char *config = NULL;
    if (!(flags & FR_TOK_NO_CONFIG)) {
        char cpath[4200];
        snprintf(cpath, sizeof cpath, "%s/tokenizer_config.json", dir);
        config = read_all(cpath, &config_len, &missing);
        if (!config && !missing) {
            free(json);
            return FR_EIO;
        }
    }
    fr_status st = fr_tokenizer_from_json(json, len, config, config_len, file, out);
    free(json);
    free(config);
    return st;
}

fr_status fr_tokenizer_load(const char *path, fr_tokenizer **out) { return fr_tokenizer_load_opts(path, 0, out); }

void tok_components_free(fr_tokenizer *t)
{
    for (size_t i = 0; i < t->n_norm; i++) {
        tok_regex_free(&t->norm[i].re);
        free(t->norm[i].text);
    }
    for (size_t i = 0; i < t->n_pre; i++) tok_regex_free(&t->pre[i].re);
    for (size_t i = 0; i < t->n_dec; i++) {
        tok_regex_free(&t->dec[i].re);
        free(t->dec[i].text);
    }
    free(t->norm);
    free(t->pre);
    free(t->dec);
    free(t->tmpl);
}

void fr_tokenizer_free(fr_tokenizer **tok)
{
    if (!tok || !*tok) return;
    fr_tokenizer *t = *tok;
    for (size_t i = 0; i < t->n_pool; i++) tok_ws_free(t->pool[i]);
    free(t->pool);
    pthread_mutex_destroy(&t->pool_lock);
    tok_components_free(t);
    tok_strmap_free(&t->bpe.vocab);
    tok_pairmap_free(&t->bpe.merges);
    free(t->bpe.prefix);
    free(t->bpe.suffix);
    free(t->added);
    tok_strmap_free(&t->added_map);
    tok_trie_free(&t->raw_trie);
    tok_trie_free(&t->norm_trie);
    free(t->id_off);
    free(t->id_len);
    free(t->id_added);
    free(t->id_special);
    fr_buf_free(&t->str);
    free(t);
    *tok = NULL;
}

int fr_tokenizer_vocab_size(const fr_tokenizer *tok) { return tok ? tok->n_ids : 0; }

int fr_tokenizer_token_id(const fr_tokenizer *tok, const char *token)
{
    if (!tok || !token) return -1;
    size_t n = strlen(token);
    int id = tok_strmap_get(&tok->added_map, tok->str.data, token, n);
    return id >= 0 ? id : tok_strmap_get(&tok->bpe.vocab, tok->str.data, token, n);
}

const char *fr_tokenizer_id_token(const fr_tokenizer *tok, int id, size_t *len)
{
    if (!tok || id < 0 || id >= tok->n_ids) return NULL;
    if (tok->id_added[id] >= 0) {
        const tok_added *a = &tok->added[tok->id_added[id]];
        if (len) *len = a->nlen;
        return tok->str.data + a->noff;
    }
    if (tok->id_len[id] == UINT32_MAX) return NULL;
    if (len) *len = tok->id_len[id];
    return tok->str.data + tok->id_off[id];
}

int fr_tokenizer_is_special(const fr_tokenizer *tok, int id)
{
    return tok && id >= 0 && id < tok->n_ids && tok->id_special[id];
}

int fr_tokenizer_bos_id(const fr_tokenizer *tok) { return tok ? tok->bos_id : -1; }
int fr_tokenizer_eos_id(const fr_tokenizer *tok) { return tok ? tok->eos_id : -1; }
