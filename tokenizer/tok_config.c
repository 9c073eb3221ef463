/* tokenizer_config.json, the transformers side of a checkpoint's
 * tokenizer: the names of the bos and eos tokens, and for the classes whose
 * transformers tokenizer rebuilds the post-processor at load (Llama,
 * CodeLlama, Gemma: `update_post_processor`), the template it builds from
 * add_bos_token (default true) and add_eos_token (default false). That is
 * why DeepSeek-V3, whose tokenizer.json adds nothing, starts with
 * <｜begin▁of▁sentence｜> when transformers encodes with special tokens. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

/* A special token entry: "text" or {"content": "text", ...}. */
static const char *token_name(const cJSON *root, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (cJSON_IsString(v)) return v->valuestring;
    return tok_json_str(v, "content");
}

static int rebuilds_template(const char *cls)
{
    static const char *const classes[] = {"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer",
                                          "CodeLlamaTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast"};
    for (size_t i = 0; cls && i < sizeof classes / sizeof *classes; i++)
        if (strcmp(cls, classes[i]) == 0) return 1;
    return 0;
}

/* add_bos_token / add_eos_token: absent or null gives def. */
static int flag(const cJSON *root, const char *key, int def)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : def;
}

static fr_status rebuild_template(fr_tokenizer *t, const cJSON *root, const char *bos, const char *eos)
{
    int add_bos = flag(root, "add_bos_token", 1), add_eos = flag(root, "add_eos_token", 0);
    if ((add_bos && t->bos_id < 0) || (add_eos && t->eos_id < 0)) {
        const char *which = add_bos && t->bos_id < 0 ? "bos" : "eos", *name = which[0] == 'b' ? bos : eos;
        return fr_fail(FR_EFORMAT, "add_%s_token is set but the %s token %s%s%s is not in the vocabulary", which,
                       which, name ? "\"" : "", name ? name : "(none)", name ? "\"" : "");
    }
    int *v = malloc(3 * sizeof *v), n = 0;
    if (!v) return fr_fail(FR_ENOMEM, "out of memory");
    if (add_bos) v[n++] = t->bos_id;
    v[n++] = TOK_TMPL_SEQ;
    if (add_eos) v[n++] = t->eos_id;
    free(t->tmpl);
    t->tmpl = v;
    t->n_tmpl = (size_t)n;
    t->has_tmpl = 1;
    return FR_OK;
}

fr_status tok_apply_config(fr_tokenizer *t, const char *json, size_t len, const char *label)
{
    const size_t valid = tok_utf8_valid_prefix(json, len);   /* as tokenizer.json: JSON is UTF-8 */
    if (valid != len)
        return fr_fail(FR_EFORMAT, "tokenizer_config.json beside %s is not UTF-8 (byte %zu)", label, valid);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fr_fail(FR_EFORMAT, "tokenizer_config.json beside %s is not a JSON object", label);
    }
    const char *bos = token_name(root, "bos_token"), *eos = token_name(root, "eos_token");
    t->bos_id = bos ? fr_tokenizer_token_id(t, bos) : -1;
    t->eos_id = eos ? fr_tokenizer_token_id(t, eos) : -1;
    fr_status st = FR_OK;
    if (rebuilds_template(tok_json_str(root, "tokenizer_class"))) {
        st = rebuild_template(t, root, bos, eos);
        if (st != FR_OK) st = fr_fail(st, "tokenizer_config.json beside %s: %s", label, fr_last_error());
    }
    cJSON_Delete(root);
    return st;
}
