/* The strict getters of decoding (proto_decode.h): one key of a msgpack
 * map each, its type and range checked, every failure naming the key. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_bridge/protocol/proto_decode.h"

const char *fr_dec_kind(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "a boolean";
    case MSGPACK_OBJECT_POSITIVE_INTEGER: return "an integer";
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "a negative integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "a float";
    case MSGPACK_OBJECT_STR: return "a string";
    case MSGPACK_OBJECT_ARRAY: return "an array";
    case MSGPACK_OBJECT_MAP: return "a map";
    case MSGPACK_OBJECT_BIN: return "binary data";
    case MSGPACK_OBJECT_EXT: return "an extension value";
    default: return "an unknown value";
    }
}

static int key_is(const msgpack_object *k, const char *name)
{
    size_t n = strlen(name);
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && memcmp(k->via.str.ptr, name, n) == 0;
}

const msgpack_object *fr_dec_find(const msgpack_object_map *m, const char *name)
{
    for (uint32_t i = 0; i < m->size; i++)
        if (key_is(&m->ptr[i].key, name)) return &m->ptr[i].val;
    return NULL;
}

/* Every key a string, listed in `allowed`, and given once. */
fr_status fr_dec_check_keys(const fr_dec_ctx *c, const char *const *allowed, int n_allowed)
{
    const msgpack_object_map *m = c->map;
    for (uint32_t i = 0; i < m->size; i++) {
        const msgpack_object *k = &m->ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return BAD("%s: %skeys must be strings, found %s", c->type, c->prefix, fr_dec_kind(k));
        int known = 0;
        for (int a = 0; a < n_allowed && !known; a++) known = key_is(k, allowed[a]);
        char shown[4 * 64 + 1];   /* the key as text, cut to 64 bytes, non-UTF-8 bytes escaped */
        fr_utf8_escape(k->via.str.ptr, k->via.str.size > 64 ? 64 : k->via.str.size, shown, sizeof shown);
        if (!fr_utf8_valid(k->via.str.ptr, k->via.str.size))
            return BAD("%s: key \"%s%s\" is not valid UTF-8", c->type, c->prefix, shown);
        if (!known)
            return BAD("%s: unknown key \"%s%s\"", c->type, c->prefix, shown);
        for (uint32_t j = 0; j < i; j++)
            if (m->ptr[j].key.type == MSGPACK_OBJECT_STR && m->ptr[j].key.via.str.size == k->via.str.size &&
                memcmp(m->ptr[j].key.via.str.ptr, k->via.str.ptr, k->via.str.size) == 0)
                return BAD("%s: key \"%s%s\" given twice", c->type, c->prefix, shown);
    }
    return FR_OK;
}

/* The value of key, or NULL when absent (nil counts as absent where the key
 * is optional); a missing required key fails. */
fr_status fr_dec_get(const fr_dec_ctx *c, const char *name, int required, const msgpack_object **out)
{
    *out = NULL;
    const msgpack_object *o = fr_dec_find(c->map, name);
    if (o && o->type == MSGPACK_OBJECT_NIL && !required) o = NULL;
    if (!o && required) return BAD("%s: missing key \"%s%s\"", c->type, c->prefix, name);
    *out = o;
    return FR_OK;
}

fr_status fr_dec_as_i64(const fr_dec_ctx *c, const char *name, const msgpack_object *o, long long lo, long long hi,
                        long long *out)
{
    long long v;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)LLONG_MAX)   /* above every range: say the value as sent */
            return BAD("%s: \"%s%s\" must be in [%lld, %lld], got %llu", c->type, c->prefix, name, lo, hi,
                       (unsigned long long)o->via.u64);
        v = (long long)o->via.u64;
    } else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        v = (long long)o->via.i64;
    } else {
        return BAD("%s: \"%s%s\" must be an integer, got %s", c->type, c->prefix, name, fr_dec_kind(o));
    }
    if (v < lo || v > hi)
        return BAD("%s: \"%s%s\" must be in [%lld, %lld], got %lld", c->type, c->prefix, name, lo, hi, v);
    *out = v;
    return FR_OK;
}

fr_status fr_dec_get_int(const fr_dec_ctx *c, const char *name, int required, long long lo, long long hi, int *out,
                         int *present)
{
    const msgpack_object *o = NULL;
    fr_status st = fr_dec_get(c, name, required, &o);
    if (present) *present = o != NULL;
    if (st || !o) return st;
    long long v = 0;
    if ((st = fr_dec_as_i64(c, name, o, lo, hi, &v))) return st;
    *out = (int)v;
    return FR_OK;
}

fr_status fr_dec_get_u64(const fr_dec_ctx *c, const char *name, int required, uint64_t *out, int *present)
{
    const msgpack_object *o = NULL;
    fr_status st = fr_dec_get(c, name, required, &o);
    if (present) *present = o != NULL;
    if (st || !o) return st;
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return BAD("%s: \"%s%s\" must be an integer >= 0, got %s", c->type, c->prefix, name,
                   o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? "a negative integer" : fr_dec_kind(o));
    *out = o->via.u64;
    return FR_OK;
}

fr_status fr_dec_as_double(const fr_dec_ctx *c, const char *name, const msgpack_object *o, double *out)
{
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *out = (double)o->via.u64; return FR_OK;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *out = (double)o->via.i64; return FR_OK;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: *out = o->via.f64; return FR_OK;
    default: return BAD("%s: \"%s%s\" must be a number, got %s", c->type, c->prefix, name, fr_dec_kind(o));
    }
}

fr_status fr_dec_get_double(const fr_dec_ctx *c, const char *name, int required, double *out, int *present)
{
    const msgpack_object *o = NULL;
    fr_status st = fr_dec_get(c, name, required, &o);
    if (present) *present = o != NULL;
    if (st || !o) return st;
    return fr_dec_as_double(c, name, o, out);
}

fr_status fr_dec_get_bool(const fr_dec_ctx *c, const char *name, int required, int *out)
{
    const msgpack_object *o = NULL;
    fr_status st = fr_dec_get(c, name, required, &o);
    if (st || !o) return st;
    if (o->type != MSGPACK_OBJECT_BOOLEAN)
        return BAD("%s: \"%s%s\" must be a boolean, got %s", c->type, c->prefix, name, fr_dec_kind(o));
    *out = o->via.boolean ? 1 : 0;
    return FR_OK;
}

fr_status fr_dec_get_str(const fr_dec_ctx *c, const char *name, int required, char *buf, size_t cap)
{
    const msgpack_object *o = NULL;
    fr_status st = fr_dec_get(c, name, required, &o);
    if (st || !o) return st;
    if (o->type != MSGPACK_OBJECT_STR)
        return BAD("%s: \"%s%s\" must be a string, got %s", c->type, c->prefix, name, fr_dec_kind(o));
    if (o->via.str.size >= cap)
        return BAD("%s: \"%s%s\" is %u bytes, the limit is %zu", c->type, c->prefix, name, o->via.str.size,
                   cap - 1);
    if (memchr(o->via.str.ptr, 0, o->via.str.size))
        return BAD("%s: \"%s%s\" holds a NUL byte", c->type, c->prefix, name);
    if (!fr_utf8_valid(o->via.str.ptr, o->via.str.size))
        return BAD("%s: \"%s%s\" is not valid UTF-8", c->type, c->prefix, name);
    memcpy(buf, o->via.str.ptr, o->via.str.size);
    buf[o->via.str.size] = 0;
    return FR_OK;
}

fr_status fr_dec_get_array(const fr_dec_ctx *c, const char *name, int required, const msgpack_object_array **out)
{
    const msgpack_object *o = NULL;
    fr_status st = fr_dec_get(c, name, required, &o);
    *out = NULL;
    if (st || !o) return st;
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return BAD("%s: \"%s%s\" must be an array, got %s", c->type, c->prefix, name, fr_dec_kind(o));
    if (o->via.array.size > FR_PROTO_MAX_ARRAY)
        return BAD("%s: \"%s%s\" holds %u entries, the limit is %d", c->type, c->prefix, name, o->via.array.size,
                   FR_PROTO_MAX_ARRAY);
    *out = &o->via.array;
    return FR_OK;
}

/* The bytes of a msgpack str of at most max bytes, UTF-8, NUL as allowed. */
static fr_status str_of(const fr_dec_ctx *c, const char *name, const msgpack_object *o, size_t max, int nul_ok)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return BAD("%s: \"%s%s\" must be a string, got %s", c->type, c->prefix, name, fr_dec_kind(o));
    if (o->via.str.size > max)
        return BAD("%s: \"%s%s\" is %u bytes, the limit is %zu", c->type, c->prefix, name, o->via.str.size, max);
    if (!nul_ok && memchr(o->via.str.ptr, 0, o->via.str.size))
        return BAD("%s: \"%s%s\" holds a NUL byte", c->type, c->prefix, name);
    if (!fr_utf8_valid(o->via.str.ptr, o->via.str.size))
        return BAD("%s: \"%s%s\" is not valid UTF-8", c->type, c->prefix, name);
    return FR_OK;
}

static char *copy_str(const msgpack_object *o)
{
    char *s = malloc((size_t)o->via.str.size + 1);
    if (!s) return NULL;
    memcpy(s, o->via.str.ptr, o->via.str.size);
    s[o->via.str.size] = '\0';
    return s;
}

fr_status fr_dec_get_text(const fr_dec_ctx *c, const char *name, int required, size_t max, char **out, size_t *len,
                          int *present)
{
    const msgpack_object *o = NULL;
    fr_status st = fr_dec_get(c, name, required, &o);
    if (present) *present = o != NULL;
    if (st || !o) return st;
    if ((st = str_of(c, name, o, max, 1))) return st;
    if (!(*out = copy_str(o))) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"%s\"", c->type, name);
    *len = o->via.str.size;
    return FR_OK;
}

fr_status fr_dec_get_strs(const fr_dec_ctx *c, const char *name, int max_n, size_t max_bytes, char ***out, int *n)
{
    const msgpack_object_array *a;
    fr_status st = fr_dec_get_array(c, name, 0, &a);
    if (st || !a) return st;
    if (a->size < 1 || a->size > (uint32_t)max_n)
        return BAD("%s: \"%s%s\" must hold 1 to %d strings, got %u", c->type, c->prefix, name, max_n, a->size);
    if (!(*out = calloc(a->size, sizeof **out))) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"%s\"", c->type, name);
    *n = (int)a->size;   /* the caller frees what was read so far, whatever happens */
    for (uint32_t i = 0; i < a->size; i++) {
        char elem[64];
        snprintf(elem, sizeof elem, "%s[%u]", name, i);
        if ((st = str_of(c, elem, &a->ptr[i], max_bytes, 0))) return st;
        if (a->ptr[i].via.str.size == 0) return BAD("%s: \"%s%s\" is empty", c->type, c->prefix, elem);
        if (!((*out)[i] = copy_str(&a->ptr[i]))) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"%s\"", c->type, name);
    }
    return FR_OK;
}

/* The array `name` (*a NULL when absent) and, when present, room for its
 * elements in *room (a 1-entry allocation for an empty array, so present
 * arrays are never NULL); *present, when asked, says which. */
static fr_status array_room(const fr_dec_ctx *c, const char *name, int required, size_t elem,
                            const msgpack_object_array **a, void **room, int *present)
{
    fr_status st = fr_dec_get_array(c, name, required, a);
    if (present) *present = *a != NULL;
    *room = NULL;
    if (st || !*a) return st;
    *room = malloc(elem * ((*a)->size ? (*a)->size : 1));
    if (!*room) return fr_fail(FR_ENOMEM, "%s: out of memory reading \"%s\"", c->type, name);
    return FR_OK;
}

/* An array of integers in [lo, hi] into a new int array (a 1-entry
 * allocation for an empty array, so present arrays are never NULL). */
fr_status fr_dec_get_ints(const fr_dec_ctx *c, const char *name, int required, long long lo, long long hi, int **out,
                          int *n, int *present)
{
    const msgpack_object_array *a;
    void *room;
    fr_status st = array_room(c, name, required, sizeof(int), &a, &room, present);
    if (st || !a) return st;
    int *v = room;
    for (uint32_t i = 0; i < a->size; i++) {
        const msgpack_object *e = &a->ptr[i];
        long long x;
        if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER && e->type != MSGPACK_OBJECT_NEGATIVE_INTEGER) {
            free(v);
            return BAD("%s: \"%s%s\"[%u] must be an integer, got %s", c->type, c->prefix, name, i, fr_dec_kind(e));
        }
        if (e->type == MSGPACK_OBJECT_POSITIVE_INTEGER && e->via.u64 > (uint64_t)LLONG_MAX) {
            free(v);
            return BAD("%s: \"%s%s\"[%u] must be in [%lld, %lld], got %llu", c->type, c->prefix, name, i, lo, hi,
                       (unsigned long long)e->via.u64);
        }
        x = e->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? (long long)e->via.i64 : (long long)e->via.u64;
        if (x < lo || x > hi) {
            free(v);
            return BAD("%s: \"%s%s\"[%u] must be in [%lld, %lld], got %lld", c->type, c->prefix, name, i, lo, hi, x);
        }
        v[i] = (int)x;
    }
    *out = v;
    *n = (int)a->size;
    return FR_OK;
}

fr_status fr_dec_get_u64s(const fr_dec_ctx *c, const char *name, int required, uint64_t **out, int *n, int *present)
{
    const msgpack_object_array *a;
    void *room;
    fr_status st = array_room(c, name, required, sizeof(uint64_t), &a, &room, present);
    if (st || !a) return st;
    uint64_t *v = room;
    for (uint32_t i = 0; i < a->size; i++) {
        if (a->ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
            free(v);
            return BAD("%s: \"%s%s\"[%u] must be an integer >= 0, got %s", c->type, c->prefix, name, i,
                       fr_dec_kind(&a->ptr[i]));
        }
        v[i] = a->ptr[i].via.u64;
    }
    *out = v;
    *n = (int)a->size;
    return FR_OK;
}

fr_status fr_dec_get_floats(const fr_dec_ctx *c, const char *name, float **out, int *n)
{
    const msgpack_object_array *a;
    void *room;
    fr_status st = array_room(c, name, 1, sizeof(float), &a, &room, NULL);
    if (st) return st;
    float *v = room;
    for (uint32_t i = 0; i < a->size; i++) {
        double x;
        char elem[96];
        snprintf(elem, sizeof elem, "%s[%u]", name, i);
        if ((st = fr_dec_as_double(c, elem, &a->ptr[i], &x))) {
            free(v);
            return st;
        }
        v[i] = (float)x;
    }
    *out = v;
    *n = (int)a->size;
    return FR_OK;
}

/* A nested map under key; *sub gets its context. */
fr_status fr_dec_get_map(const fr_dec_ctx *c, const char *name, const char *prefix, fr_dec_ctx *sub)
{
    const msgpack_object *o;
    fr_status st = fr_dec_get(c, name, 1, &o);
    if (st) return st;
    if (o->type != MSGPACK_OBJECT_MAP)
        return BAD("%s: \"%s%s\" must be a map, got %s", c->type, c->prefix, name, fr_dec_kind(o));
    *sub = (fr_dec_ctx){.type = c->type, .prefix = prefix, .map = &o->via.map};
    return FR_OK;
}

