/* The byte-level models' tokenizer (the bundled demo model, the project's
 * test models): ids 0-255 are bytes, the ids above are special tokens. It
 * is made as the tokenizer.json such a model would ship, a byte-level BPE
 * without merges, so encoding, decoding and streaming go through the same
 * code as any checkpoint's tokenizer and the engine needs no second path
 * for text. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

/* The spelling of special token id: "<ID>", as the Python client's
 * ByteTokenizer writes a special token it does not skip. */
static void special_name(int id, char *out, size_t cap) { snprintf(out, cap, "<%d>", id); }

static cJSON *add_obj(cJSON *parent, const char *key)
{
    cJSON *o = cJSON_CreateObject();
    if (o && !cJSON_AddItemToObject(parent, key, o)) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

/* {"type": "ByteLevel", ...} without the regex: every byte is its own piece. */
static int add_bytelevel(cJSON *root, const char *key)
{
    cJSON *o = add_obj(root, key);
    return o && cJSON_AddStringToObject(o, "type", "ByteLevel") && cJSON_AddFalseToObject(o, "add_prefix_space") &&
           cJSON_AddFalseToObject(o, "trim_offsets") && cJSON_AddFalseToObject(o, "use_regex");
}

static int add_model(cJSON *root)
{
    cJSON *m = add_obj(root, "model");
    cJSON *vocab = m ? add_obj(m, "vocab") : NULL;
    if (!vocab || !cJSON_AddStringToObject(m, "type", "BPE") || !cJSON_AddArrayToObject(m, "merges")) return 0;
    for (int b = 0; b < 256; b++) {
        char ch[5] = {0};
        tok_utf8_put(tok_byte_char((unsigned char)b), ch);
        if (!cJSON_AddNumberToObject(vocab, ch, b)) return 0;
    }
    return 1;
}

/* Every id from 256 up as a special token, in id order (tokenizers gives an
 * added token the next id after the vocabulary, so the order is the ids). */
static int add_specials(cJSON *root, int vocab_size)
{
    cJSON *list = cJSON_AddArrayToObject(root, "added_tokens");
    for (int id = 256; list && id < vocab_size; id++) {
        char name[24];
        special_name(id, name, sizeof name);
        cJSON *t = cJSON_CreateObject();
        if (!t || !cJSON_AddItemToArray(list, t)) {
            cJSON_Delete(t);
            return 0;
        }
        if (!cJSON_AddNumberToObject(t, "id", id) || !cJSON_AddStringToObject(t, "content", name) ||
            !cJSON_AddFalseToObject(t, "single_word") || !cJSON_AddFalseToObject(t, "lstrip") ||
            !cJSON_AddFalseToObject(t, "rstrip") || !cJSON_AddFalseToObject(t, "normalized") ||
            !cJSON_AddTrueToObject(t, "special"))
            return 0;
    }
    return list != NULL;
}

/* TemplateProcessing: bos_id, then the text. */
static int add_template(cJSON *root, int bos_id)
{
    char name[24];
    special_name(bos_id, name, sizeof name);
    cJSON *p = add_obj(root, "post_processor");
    cJSON *single = p ? cJSON_AddArrayToObject(p, "single") : NULL;
    cJSON *a = cJSON_CreateObject(), *b = cJSON_CreateObject();
    if (!single || !a || !b || !cJSON_AddItemToArray(single, a)) {
        cJSON_Delete(a);
        cJSON_Delete(b);
        return 0;
    }
    if (!cJSON_AddItemToArray(single, b)) {
        cJSON_Delete(b);
        return 0;
    }
    cJSON *sa = add_obj(a, "SpecialToken"), *sb = add_obj(b, "Sequence");
    cJSON *specials = add_obj(p, "special_tokens");
    cJSON *entry = specials ? add_obj(specials, name) : NULL;
    cJSON *ids = entry ? cJSON_AddArrayToObject(entry, "ids") : NULL;
    cJSON *bos = cJSON_CreateNumber(bos_id);
    if (!ids || !bos || !cJSON_AddItemToArray(ids, bos)) {
        cJSON_Delete(bos);
        return 0;
    }
    return sa && sb && cJSON_AddStringToObject(p, "type", "TemplateProcessing") &&
           cJSON_AddStringToObject(sa, "id", name) && cJSON_AddNumberToObject(sa, "type_id", 0) &&
           cJSON_AddStringToObject(sb, "id", "A") && cJSON_AddNumberToObject(sb, "type_id", 0) &&
           cJSON_AddStringToObject(entry, "id", name);
}

/* tokenizer_config.json naming the bos and eos tokens. */
static char *config_json(int bos_id, int eos_id)
{
    char bos[24], eos[24];
    special_name(bos_id, bos, sizeof bos);
    special_name(eos_id, eos, sizeof eos);
    cJSON *c = cJSON_CreateObject();
    char *out = NULL;
    if (c && (bos_id < 0 || cJSON_AddStringToObject(c, "bos_token", bos)) &&
        (eos_id < 0 || cJSON_AddStringToObject(c, "eos_token", eos)))
        out = cJSON_PrintUnformatted(c);
    cJSON_Delete(c);
    return out;
}

fr_status fr_tokenizer_bytes(int vocab_size, int bos_id, int eos_id, fr_tokenizer **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_tokenizer_bytes: no place for the result");
    *out = NULL;
    if (vocab_size < 256 || vocab_size > (1 << 20))
        return fr_fail(FR_EINVAL, "a byte-level vocabulary holds 256 to 2^20 ids, not %d", vocab_size);
    if ((bos_id >= 0 && (bos_id < 256 || bos_id >= vocab_size)) ||
        (eos_id >= 0 && (eos_id < 256 || eos_id >= vocab_size)))
        return fr_fail(FR_EINVAL, "byte-level tokenizer: bos %d and eos %d must be special ids, in [256, %d)",
                       bos_id, eos_id, vocab_size);
    cJSON *root = cJSON_CreateObject();
    int ok = root && cJSON_AddStringToObject(root, "version", "1.0") && cJSON_AddNullToObject(root, "truncation") &&
             cJSON_AddNullToObject(root, "padding") && add_specials(root, vocab_size) &&
             cJSON_AddNullToObject(root, "normalizer") && add_bytelevel(root, "pre_tokenizer") &&
             (bos_id < 0 ? cJSON_AddNullToObject(root, "post_processor") != NULL : add_template(root, bos_id)) &&
             add_bytelevel(root, "decoder") && add_model(root);
    char *json = ok ? cJSON_PrintUnformatted(root) : NULL;
    char *config = json ? config_json(bos_id, eos_id) : NULL;
    cJSON_Delete(root);
    fr_status st = config ? fr_tokenizer_from_json(json, strlen(json), config, strlen(config), "byte-level", out)
                          : fr_fail(FR_ENOMEM, "out of memory making the byte-level tokenizer");
    cJSON_free(json);
    cJSON_free(config);
    return st;
}
