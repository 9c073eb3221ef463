/* The strict getters of decoding (proto_get.c), shared by the message
 * decoders (proto_decode.c); not part of the public API. Each reads one key
 * of a msgpack map and fails with FR_EFORMAT naming the message type and
 * the key ("generate: \"top_p\" must be in (0, 1], got 1.5"). */
#ifndef FR_PROTO_DECODE_H
#define FR_PROTO_DECODE_H

#include <msgpack.h>

#include "trainer_bridge/protocol/proto_internal.h"

#define BAD(...) fr_fail(FR_EFORMAT, __VA_ARGS__)

/* Where a value sits, for messages: the message type and, inside a nested
 * map, the map's key ("stats_reply: scheduler.steps: ..."). */
typedef struct {
    const char *type;
    const char *prefix;          /* "" or "scheduler." */
    const msgpack_object_map *map;
} fr_dec_ctx;

/* Whether the lengths a msgpack value in data[0, len) declares are
 * plausible for its bytes (proto_bounds.c): 0 when an array, map or string
 * announces far more than the frame holds, or nesting is deeper than 64. */
int fr_proto_lengths_fit(const void *data, size_t len);

/* "an integer", "a string", ...: what a value is, for messages. */
const char *fr_dec_kind(const msgpack_object *o);
/* The value of key `name` in m, or NULL. */
const msgpack_object *fr_dec_find(const msgpack_object_map *m, const char *name);
/* Every key a string, listed in `allowed`, and given once. */
fr_status fr_dec_check_keys(const fr_dec_ctx *c, const char *const *allowed, int n_allowed);
/* The value of key, or NULL when absent (nil counts as absent where the key
 * is optional); a missing required key fails. */
fr_status fr_dec_get(const fr_dec_ctx *c, const char *name, int required, const msgpack_object **out);
fr_status fr_dec_as_i64(const fr_dec_ctx *c, const char *name, const msgpack_object *o, long long lo, long long hi,
                        long long *out);
fr_status fr_dec_as_double(const fr_dec_ctx *c, const char *name, const msgpack_object *o, double *out);
/* Optional keys (required 0) leave *out as it was when absent; *present
 * (may be NULL) says which. */
fr_status fr_dec_get_int(const fr_dec_ctx *c, const char *name, int required, long long lo, long long hi, int *out,
                         int *present);
fr_status fr_dec_get_u64(const fr_dec_ctx *c, const char *name, int required, uint64_t *out, int *present);
fr_status fr_dec_get_double(const fr_dec_ctx *c, const char *name, int required, double *out, int *present);
fr_status fr_dec_get_bool(const fr_dec_ctx *c, const char *name, int required, int *out);
/* A UTF-8 string without NUL into buf (cap bytes with the NUL). */
fr_status fr_dec_get_str(const fr_dec_ctx *c, const char *name, int required, char *buf, size_t cap);
fr_status fr_dec_get_array(const fr_dec_ctx *c, const char *name, int required, const msgpack_object_array **out);
/* A UTF-8 string of at most max bytes (NUL allowed) into a new
 * NUL-terminated buffer, *len its bytes; *present (may be NULL) says
 * whether it was given (*out stays NULL when not). */
fr_status fr_dec_get_text(const fr_dec_ctx *c, const char *name, int required, size_t max, char **out, size_t *len,
                          int *present);
/* An array of 1 to max_n strings, each 1 to max_bytes bytes of UTF-8
 * without NUL, into a new array of new strings (NULL when absent). */
fr_status fr_dec_get_strs(const fr_dec_ctx *c, const char *name, int max_n, size_t max_bytes, char ***out, int *n);
/* An array of integers in [lo, hi] into a new int array (a 1-entry
 * allocation for an empty array, so present arrays are never NULL). */
fr_status fr_dec_get_ints(const fr_dec_ctx *c, const char *name, int required, long long lo, long long hi, int **out,
                          int *n, int *present);
fr_status fr_dec_get_u64s(const fr_dec_ctx *c, const char *name, int required, uint64_t **out, int *n, int *present);
/* A required array of numbers into a new float array. */
fr_status fr_dec_get_floats(const fr_dec_ctx *c, const char *name, float **out, int *n);
/* A nested map under key; *sub gets its context, prefix naming it. */
fr_status fr_dec_get_map(const fr_dec_ctx *c, const char *name, const char *prefix, fr_dec_ctx *sub);

#define KEYS(c, ...)                                                                                   \
    do {                                                                                               \
        static const char *const allowed_[] = {__VA_ARGS__};                                           \
        fr_status ks_ = fr_dec_check_keys((c), allowed_, (int)(sizeof allowed_ / sizeof allowed_[0]));       \
        if (ks_) return ks_;                                                                           \
    } while (0)

#define TRY(x)                       \
    do {                             \
        fr_status t_ = (x);          \
        if (t_) return t_;           \
    } while (0)

#endif
