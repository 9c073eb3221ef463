/* One key of the serve configuration, typed by its row of the option
 * table: its JSON value read and checked (each error names the JSON path),
 * put into fr_serve_config at the row's place, and written back. A serve
 * flag's value goes through the same fr_serve_key_store, so a flag sets
 * exactly what its key sets. */
#include "app/serve_keys.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "LABEL: PATH: message" (FR_EINVAL). */
static fr_status bad(const char *label, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static fr_status bad(const char *label, const char *path, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fr_fail(FR_EINVAL, "%s: %s: %s", label, path, msg);
}

const char *fr_serve_json_type(const cJSON *v)
{
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "an invalid value";
}

/* ---- reading ------------------------------------------------------------- */

static fr_status read_int(const fr_opt *o, const cJSON *v, const char *label, const char *path, long long *out)
{
    if (!cJSON_IsNumber(v))
        return bad(label, path, "expected an integer in [%.0f, %.0f], got %s", o->lo, o->hi, fr_serve_json_type(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return bad(label, path, "expected an integer in [%.0f, %.0f], got %g", o->lo, o->hi, d);
    if (d < o->lo || d > o->hi) return bad(label, path, "must be in [%.0f, %.0f], got %.0f", o->lo, o->hi, d);
    *out = (long long)d;
    return FR_OK;
}

static fr_status read_num(const fr_opt *o, const cJSON *v, const char *label, const char *path, double *out)
{
    const char open = o->lo_open ? '(' : '[';
    if (!cJSON_IsNumber(v))
        return bad(label, path, "expected a number in %c%g, %g], got %s", open, o->lo, o->hi, fr_serve_json_type(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d < o->lo || d > o->hi || (o->lo_open && d == o->lo))
        return bad(label, path, "must be in %c%g, %g], got %g", open, o->lo, o->hi, d);
    *out = d;
    return FR_OK;
}

/* JSON numbers hold integers exactly up to 2^53; null: none. */
static fr_status read_seed(const fr_opt *o, const cJSON *v, const char *label, const char *path, fr_opt_value *out)
{
    if (o->nullable && cJSON_IsNull(v)) return FR_OK;
    if (!cJSON_IsNumber(v)) return bad(label, path, "expected an integer in [0, 2^53], got %s", fr_serve_json_type(v));
    double d = v->valuedouble;
    if (d != floor(d) || d < 0 || d > 9007199254740992.0)
        return bad(label, path, "expected an integer in [0, 2^53], got %g", d);
    out->u = (uint64_t)d;
    out->has = 1;
    return FR_OK;
}

/* A non-empty string that fits the row's size; null is none when nullable. */
static fr_status read_str(const fr_opt *o, int nullable, const cJSON *v, const char *label, const char *path,
                          const char **out)
{
    if (nullable && cJSON_IsNull(v)) return FR_OK;
    if (!cJSON_IsString(v))
        return bad(label, path, "expected a string%s, got %s", nullable ? " or null" : "", fr_serve_json_type(v));
    size_t n = strlen(v->valuestring);
    if (n == 0) return bad(label, path, "must not be empty%s", nullable ? " (use null for none)" : "");
    if (n >= o->size) return bad(label, path, "is %zu bytes long; at most %zu", n, o->size - 1);
    *out = v->valuestring;
    return FR_OK;
}

static fr_status read_key(const fr_opt *o, const cJSON *v, const char *label, const char *path, const char **out)
{
    if (o->type == FR_OPT_KEY && o->nullable && cJSON_IsNull(v)) return FR_OK;
    if (!cJSON_IsString(v))
        return bad(label, path, "expected a CURVE key (40 Z85 characters), got %s", fr_serve_json_type(v));
    if (!fr_opt_z85_key(v->valuestring))
        return bad(label, path, "expected a CURVE key of 40 Z85 characters (fp4rollout-client keygen makes one)");
    *out = v->valuestring;
    return FR_OK;
}

/* IDS, FILES, KEYS: an array of n_min to n_max entries. */
static fr_status read_list(const fr_opt *o, const cJSON *v, const char *label, const char *path, fr_opt_value *out)
{
    const char *what = o->type == FR_OPT_IDS     ? "token ids"
                       : o->type == FR_OPT_FILES ? "text files"
                                                 : "CURVE public keys";
    const char *unit = o->type == FR_OPT_IDS ? "ids" : o->type == FR_OPT_FILES ? "files" : "keys";
    if (!cJSON_IsArray(v)) return bad(label, path, "expected an array of %s, got %s", what, fr_serve_json_type(v));
    const int n = cJSON_GetArraySize(v);
    if (n < o->n_min) return bad(label, path, "has %d %s; give %d to %d", n, unit, o->n_min, o->n_max);
    if (n > o->n_max) return bad(label, path, "has %d %s; at most %d", n, unit, o->n_max);
    if (o->type == FR_OPT_IDS) out->ids = malloc(sizeof(int) * (size_t)(n ? n : 1));
    else out->list = malloc(sizeof(char *) * (size_t)(n ? n : 1));
    if (!out->ids && !out->list) return fr_fail(FR_ENOMEM, "out of memory");
    fr_status st = FR_OK;
    int i = 0;
    for (const cJSON *e = v->child; e && !st; e = e->next, i++) {
        char epath[300];
        long long id = 0;
        snprintf(epath, sizeof epath, "%s[%d]", path, i);
        if (o->type == FR_OPT_IDS && !(st = read_int(o, e, label, epath, &id))) out->ids[i] = (int)id;
        else if (o->type == FR_OPT_FILES) st = read_str(o, 0, e, label, epath, &out->list[i]);
        else if (o->type == FR_OPT_KEYS) st = read_key(o, e, label, epath, &out->list[i]);
    }
    out->n = n;
    return st;
}

fr_status fr_serve_key_read(const fr_opt *o, const cJSON *v, const char *label, const char *path, fr_opt_value *out)
{
    fr_opt_value_clear(out);
    out->given = 1;
    int choice = 0;
    char why[512];
    switch (o->type) {
    case FR_OPT_FLAG:
        if (!cJSON_IsBool(v)) return bad(label, path, "expected true or false, got %s", fr_serve_json_type(v));
        out->i = cJSON_IsTrue(v);
        return FR_OK;
    case FR_OPT_INT:
    case FR_OPT_LONG: return read_int(o, v, label, path, &out->i);
    case FR_OPT_NUM:
    case FR_OPT_FLOAT: return read_num(o, v, label, path, &out->d);
    case FR_OPT_SEED: return read_seed(o, v, label, path, out);
    case FR_OPT_STR: return read_str(o, o->nullable, v, label, path, &out->s);
    case FR_OPT_KEY: return read_key(o, v, label, path, &out->s);
    case FR_OPT_CHOICE:
    case FR_OPT_RECIPE:
        if (!cJSON_IsString(v)) return bad(label, path, "expected a string, got %s", fr_serve_json_type(v));
        if (o->type == FR_OPT_CHOICE ? o->choice.parse(v->valuestring, &choice) == FR_OK
                                     : fr_recipe_parse(v->valuestring, &out->recipe) == FR_OK) {
            out->i = choice;
            return FR_OK;
        }
        snprintf(why, sizeof why, "%s", fr_last_error());
        return bad(label, path, "%s", why);
    case FR_OPT_IDS:
    case FR_OPT_FILES:
    case FR_OPT_KEYS: return read_list(o, v, label, path, out);
    }
    return bad(label, path, "has a type the option table does not know");
}

/* ---- storing and writing ------------------------------------------------- */

static void copy_str(char *dst, size_t cap, const char *s)
{
    snprintf(dst, cap, "%s", s ? s : "");
}

void fr_serve_key_store(const fr_opt *o, const fr_opt_value *v, fr_serve_config *c)
{
    char *at = (char *)c + o->at;
    int *count = (int *)((char *)c + o->count_at);
    const int one_int = (int)v->i;
    const float one_float = (float)v->d;
    switch (o->type) {
    case FR_OPT_FLAG:
    case FR_OPT_INT:
    case FR_OPT_CHOICE: memcpy(at, &one_int, sizeof one_int); break;
    case FR_OPT_LONG: memcpy(at, &v->i, sizeof v->i); break;
    case FR_OPT_NUM: memcpy(at, &v->d, sizeof v->d); break;
    case FR_OPT_FLOAT: memcpy(at, &one_float, sizeof one_float); break;
    case FR_OPT_SEED:
        if (v->has) memcpy(at, &v->u, sizeof v->u);
        *count = v->has;
        break;
    case FR_OPT_STR:
    case FR_OPT_KEY: copy_str(at, o->size, v->s); break;
    case FR_OPT_RECIPE: memcpy(at, &v->recipe, sizeof v->recipe); break;
    case FR_OPT_IDS:
        if (v->n) memcpy(at, v->ids, sizeof(int) * (size_t)v->n);
        *count = v->n;
        break;
    case FR_OPT_FILES:
    case FR_OPT_KEYS:
        for (int i = 0; i < v->n; i++) copy_str(at + (size_t)i * o->size, o->size, v->list[i]);
        *count = v->n;
        break;
    }
}

static cJSON *string_or_null(const fr_opt *o, const char *s)
{
    return !s[0] && o->nullable ? cJSON_CreateNull() : cJSON_CreateString(s);
}

/* An array of the count strings (FILES, KEYS) or ids at the row's place. */
static cJSON *list_json(const fr_opt *o, const char *at, int count)
{
    if (o->type == FR_OPT_IDS) return cJSON_CreateIntArray((const int *)(const void *)at, count);
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < count; i++) {
        cJSON *s = cJSON_CreateString(at + (size_t)i * o->size);
        if (!s) {
            cJSON_Delete(a);
            return NULL;
        }
        cJSON_AddItemToArray(a, s);
    }
    return a;
}

cJSON *fr_serve_key_json(const fr_opt *o, const fr_serve_config *c)
{
    const char *at = (const char *)c + o->at;
    int i = 0, count = 0;
    long long ll = 0;
    double d = 0;
    float f = 0;
    uint64_t u = 0;
    char recipe[128];
    if (o->count_at) memcpy(&count, (const char *)c + o->count_at, sizeof count);
    switch (o->type) {
    case FR_OPT_FLAG: memcpy(&i, at, sizeof i); return cJSON_CreateBool(i);
    case FR_OPT_INT: memcpy(&i, at, sizeof i); return cJSON_CreateNumber(i);
    case FR_OPT_LONG: memcpy(&ll, at, sizeof ll); return cJSON_CreateNumber((double)ll);
    case FR_OPT_NUM: memcpy(&d, at, sizeof d); return cJSON_CreateNumber(d);
    case FR_OPT_FLOAT: memcpy(&f, at, sizeof f); return cJSON_CreateNumber(f);
    case FR_OPT_SEED: memcpy(&u, at, sizeof u); return count ? cJSON_CreateNumber((double)u) : cJSON_CreateNull();
    case FR_OPT_STR:
    case FR_OPT_KEY: return string_or_null(o, at);
    case FR_OPT_CHOICE: memcpy(&i, at, sizeof i); return cJSON_CreateString(o->choice.name(i));
    case FR_OPT_RECIPE:
        fr_recipe_format((const fr_recipe *)(const void *)at, recipe, (int)sizeof recipe);
        return cJSON_CreateString(recipe);
    case FR_OPT_IDS:
    case FR_OPT_FILES:
    case FR_OPT_KEYS: return list_json(o, at, count);
    }
    return NULL;
}
