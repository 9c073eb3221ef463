/* Field readers shared by the component loaders (tok_load_pipeline.c,
 * tok_load_output.c): one place decides what a malformed field is refused
 * with, so every component words its refusals alike. */
#include <stdio.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

/* How deep Sequences may nest: real files nest one level; a bound keeps a
 * hostile file from exhausting the stack. */
enum { MAX_DEPTH = 8 };

fr_status tok_field_bool(const cJSON *j, const char *key, int def, const char *where, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    *out = def;
    if (!v || cJSON_IsNull(v)) return FR_OK;
    if (!cJSON_IsBool(v)) return fr_fail(FR_EFORMAT, "%s: \"%s\" is not a boolean", where, key);
    *out = cJSON_IsTrue(v);
    return FR_OK;
}

fr_status tok_field_char(const cJSON *j, const char *key, const char *where, uint32_t *out)
{
    const char *s = tok_json_str(j, key);
    size_t n = s ? strlen(s) : 0;
    if (!n || tok_utf8_valid_prefix(s, n) != n || (size_t)tok_utf8_next(s, out) != n)
        return fr_fail(FR_EFORMAT, "%s: \"%s\" is not a string of one character", where, key);
    return FR_OK;
}

fr_status tok_field_pattern(const cJSON *j, const char *where, tok_regex *re)
{
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(j, "pattern");
    const char *s = tok_json_str(p, "String"), *r = tok_json_str(p, "Regex");
    if (!s && !r) return fr_fail(FR_EFORMAT, "%s: \"pattern\" is neither {\"String\": ...} nor {\"Regex\": ...}", where);
    return tok_regex_compile(re, s ? s : r, strlen(s ? s : r), s != NULL, where);
}

fr_status tok_parse_sequence(fr_tokenizer *t, const cJSON *j, const char *key, const char *where, int depth,
                             tok_parse_fn parse)
{
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!cJSON_IsArray(list)) return fr_fail(FR_EFORMAT, "%s: Sequence without a \"%s\" list", where, key);
    if (depth >= MAX_DEPTH) return fr_fail(FR_EUNSUPPORTED, "%s: Sequences nested too deep", where);
    size_t i = 0;
    for (const cJSON *e = list->child; e; e = e->next, i++) {
        char sub[256];
        snprintf(sub, sizeof sub, "%s.%s[%zu]", where, key, i);
        fr_status st = parse(t, e, sub, depth + 1);
        if (st != FR_OK) return st;
    }
    return FR_OK;
}
