/* The option table's rows (app/options.def), the names of the commands,
 * and the reading of a value from the command line's text. */
#include "app/options.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "app/serve_config.h"
#include "base/dtype.h"
#include "base/log.h"
#include "rollout/engine/session.h"
#include "rollout/monitor/eval_kl.h"
#include "rollout/monitor/eval_task.h"
#include "trainer_bridge/protocol/protocol.h"

/* ---- the choices: a name read into an int, and back ---------------------- */

/* The project's own parsers of an enumeration, as parsers into an int. */
#define ENUM_PARSER(x, type, fn)                                                                  \
    static fr_status parse_##x(const char *s, int *out)                                           \
    {                                                                                             \
        type v = (type)0;                                                                         \
        fr_status st = fn(s, &v);                                                                 \
        *out = (int)v;                                                                            \
        return st;                                                                                \
    }
ENUM_PARSER(log_level, fr_log_level, fr_log_level_parse)
ENUM_PARSER(fp4_format, fr_fp4_format, fr_fp4_format_parse)
ENUM_PARSER(kv_dtype, fr_kv_dtype, fr_kv_dtype_parse)
ENUM_PARSER(fp4_compute, fr_fp4_compute, fr_fp4_compute_parse)

/* One of n names, read as the value beside it. */
static fr_status one_of(const char *s, const char *what, const char *const *names, const int *values, int n, int *out)
{
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = values[i];
            return FR_OK;
        }
    char expected[128] = "";
    for (int i = 0; i < n; i++)
        snprintf(expected + strlen(expected), sizeof expected - strlen(expected), "%s%s",
                 i == 0 ? "" : i + 1 < n ? ", " : " or ", names[i]);
    return fr_fail(FR_EINVAL, "unknown %s '%s' (expected %s)", what, s, expected);
}

static fr_status parse_backend(const char *s, int *out)
{
    static const char *const names[] = {"auto", "cpu", "cuda"};
    static const int values[] = {FR_BACKEND_AUTO, FR_BACKEND_CPU, FR_BACKEND_CUDA};
    return one_of(s, "backend", names, values, 3, out);
}

static fr_status parse_pause_mode(const char *s, int *out)
{
    static const char *const names[] = {"abort", "wait", "keep"};
    static const int values[] = {FR_PAUSE_ABORT, FR_PAUSE_WAIT, FR_PAUSE_KEEP};
    return one_of(s, "pause mode", names, values, 3, out);
}

static fr_status parse_wire_dtype(const char *s, int *out)
{
    static const char *const names[] = {"f32", "bf16"};
    static const int values[] = {FR_DTYPE_F32, FR_DTYPE_BF16};
    return one_of(s, "dtype", names, values, 2, out);
}

static const char *name_backend(int v) { return fr_backend_name((fr_backend)v); }
static const char *name_kv_dtype(int v) { return fr_kv_dtype_name((fr_kv_dtype)v); }
static const char *name_fp4_compute(int v) { return fr_fp4_compute_name((fr_fp4_compute)v); }
#define name_log_level NULL
#define name_fp4_format NULL
#define name_pause_mode NULL
#define name_wire_dtype NULL

/* ---- the rows ------------------------------------------------------------ */

#define CHOICE(x) {parse_##x, name_##x}
#define AT(f) .at = offsetof(fr_serve_config, f), .size = sizeof(((fr_serve_config *)0)->f)
#define AT_LIST(f, count)                                                                        \
    .at = offsetof(fr_serve_config, f), .size = sizeof(((fr_serve_config *)0)->f[0]),            \
    .count_at = offsetof(fr_serve_config, count)

const fr_opt fr_opts[FR_O_COUNT] = {
#define FR_OPT(id, ...) [FR_O_##id] = {__VA_ARGS__},
#include "app/options.def"
#undef FR_OPT
};

/* Enumerations are stored as ints in the configuration. */
_Static_assert(sizeof(fr_backend) == sizeof(int) && sizeof(fr_kv_dtype) == sizeof(int) &&
                   sizeof(fr_fp4_compute) == sizeof(int),
               "an enumeration of the serve configuration is not an int");

int fr_opt_takes(const fr_opt *o, fr_cmd cmd)
{
    return o->name && (o->cmds >> cmd & 1u);
}

/* ---- the commands -------------------------------------------------------- */

static const struct {
    const char *name;
    int client;          /* a command of fp4rollout-client */
    int max_operands;
} commands[FR_CMD_COUNT] = {
    [FR_CMD_QUANT] = {"quant", 0, 2},          [FR_CMD_DEMO] = {"demo", 0, 0},
    [FR_CMD_GENERATE] = {"generate", 0, 0},    [FR_CMD_SCORE] = {"score", 0, 0},
    [FR_CMD_CALIBRATE] = {"calibrate", 0, 0},  [FR_CMD_EVAL_KL] = {"eval-kl", 0, 0},
    [FR_CMD_EVAL_TASK] = {"eval-task", 0, 0},
    [FR_CMD_ROLLOUT] = {"rollout", 0, 0},      [FR_CMD_SERVE] = {"serve", 0, 0},
    [FR_CMD_DASHBOARD] = {"dashboard", 0, 1},  [FR_CMD_TOKENIZE] = {"tokenize", 0, 0},
    [FR_CMD_DETOKENIZE] = {"detokenize", 0, 0}, [FR_CMD_CLIENT] = {"", 1, 0},
    [FR_CMD_C_HELLO] = {"hello", 1, 0},        [FR_CMD_C_STATS] = {"stats", 1, 0},
    [FR_CMD_C_PAUSE] = {"pause", 1, 0},        [FR_CMD_C_RESUME] = {"resume", 1, 0},
    [FR_CMD_C_GENERATE] = {"generate", 1, 0},  [FR_CMD_C_PUSH_WEIGHTS] = {"push-weights", 1, 0},
    [FR_CMD_C_WATCH_METRICS] = {"watch-metrics", 1, 0}, [FR_CMD_C_KEYGEN] = {"keygen", 1, 0},
    [FR_CMD_C_SEND_RAW] = {"send-raw", 1, 0},
};

const char *fr_cmd_name(fr_cmd cmd)
{
    return cmd < FR_CMD_COUNT ? commands[cmd].name : "";
}

const char *fr_cmd_program(fr_cmd cmd)
{
    return cmd < FR_CMD_COUNT && commands[cmd].client ? "fp4rollout-client" : "fp4rollout";
}

int fr_cmd_max_operands(fr_cmd cmd)
{
    return cmd < FR_CMD_COUNT ? commands[cmd].max_operands : 0;
}

/* ---- values from text ---------------------------------------------------- */

void fr_opt_describe(const fr_opt *o, char *buf, size_t cap)
{
    const char open = o->lo_open ? '(' : '[';
    switch (o->type) {
    case FR_OPT_INT:
    case FR_OPT_LONG: snprintf(buf, cap, "an integer in [%.0f, %.0f]", o->lo, o->hi); break;
    case FR_OPT_NUM:
    case FR_OPT_FLOAT: snprintf(buf, cap, "a number in %c%g, %g]", open, o->lo, o->hi); break;
    case FR_OPT_SEED: snprintf(buf, cap, "an integer in [0, 2^64)"); break;
    case FR_OPT_IDS: snprintf(buf, cap, "comma-separated token ids"); break;
    case FR_OPT_KEY: snprintf(buf, cap, "a CURVE key of 40 Z85 characters"); break;
    default: snprintf(buf, cap, "a value"); break;
    }
}

/* A whole number: all of text, no sign for a seed. */
static int whole(const char *text, int is_seed, long long *out, uint64_t *u)
{
    char *end = NULL;
    errno = 0;
    if (is_seed) {
        if (*text == '-' || *text == '+') return 0;
        *u = strtoull(text, &end, 10);
    } else {
        *out = strtoll(text, &end, 10);
    }
    return *text && !*end && !errno;
}

static fr_status bad_value(const fr_opt *o, const char *spelled, const char *text)
{
    char what[96];
    fr_opt_describe(o, what, sizeof what);
    return fr_fail(FR_EINVAL, "%s expects %s, got '%s'", spelled, what, text);
}

/* The reason of the last failure, prefixed by the option. */
static fr_status named(const char *spelled)
{
    char why[512];
    snprintf(why, sizeof why, "%s", fr_last_error());
    return fr_fail(FR_EINVAL, "%s: %s", spelled, why);
}

static fr_status number_from_text(const fr_opt *o, const char *spelled, const char *text, fr_opt_value *v)
{
    if (o->type == FR_OPT_INT || o->type == FR_OPT_LONG || o->type == FR_OPT_SEED) {
        if (!whole(text, o->type == FR_OPT_SEED, &v->i, &v->u)) return bad_value(o, spelled, text);
        if (o->type != FR_OPT_SEED && ((double)v->i < o->lo || (double)v->i > o->hi))
            return bad_value(o, spelled, text);
        v->has = 1;
        return FR_OK;
    }
    char *end = NULL;
    errno = 0;
    v->d = strtod(text, &end);
    if (!*text || *end || errno || !isfinite(v->d) || v->d < o->lo || v->d > o->hi || (o->lo_open && v->d == o->lo))
        return bad_value(o, spelled, text);
    return FR_OK;
}

static fr_status ids_from_text(const fr_opt *o, const char *spelled, const char *text, fr_opt_value *v)
{
    if (fr_parse_ids(text, &v->ids, &v->n)) return named(spelled);
    if (v->n < o->n_min)
        return fr_fail(FR_EINVAL, "%s needs at least %s, got '%s'", spelled,
                       o->n_min == 1 ? "one token id" : "more ids", text);
    if (o->n_max && v->n > o->n_max)
        return fr_fail(FR_EINVAL, "%s takes at most %d token ids, got %d", spelled, o->n_max, v->n);
    for (int k = 0; k < v->n; k++)
        if (v->ids[k] < o->lo || v->ids[k] > o->hi)
            return fr_fail(FR_EINVAL, "%s: token id %d is outside [%.0f, %.0f]", spelled, v->ids[k], o->lo, o->hi);
    return FR_OK;
}

int fr_opt_z85_key(const char *s)
{
    static const char z85[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
    return strlen(s) == 40 && strspn(s, z85) == 40;
}

fr_status fr_opt_from_text(const fr_opt *o, const char *spelled, const char *text, fr_opt_value *v)
{
    fr_opt_value_clear(v);
    int choice = 0;
    switch (o->type) {
    case FR_OPT_FLAG: v->i = 1; return FR_OK;
    case FR_OPT_INT:
    case FR_OPT_LONG:
    case FR_OPT_NUM:
    case FR_OPT_FLOAT:
    case FR_OPT_SEED: return number_from_text(o, spelled, text, v);
    case FR_OPT_IDS: return ids_from_text(o, spelled, text, v);
    case FR_OPT_CHOICE:
        if (o->choice.parse(text, &choice)) return named(spelled);
        v->i = choice;
        return FR_OK;
    case FR_OPT_RECIPE: return fr_recipe_parse(text, &v->recipe) ? named(spelled) : FR_OK;
    case FR_OPT_FILES: return fr_opt_add_file(v, text);
    case FR_OPT_KEYS:
        return fr_opt_z85_key(text) ? fr_opt_add_file(v, text) : bad_value(o, spelled, text);
    case FR_OPT_KEY:
        if (!fr_opt_z85_key(text)) return bad_value(o, spelled, text);
        break;
    case FR_OPT_STR:
        if (!*text && !o->empty_ok) return fr_fail(FR_EINVAL, "%s expects a non-empty value", spelled);
        if (o->size && strlen(text) >= o->size)
            return fr_fail(FR_EINVAL, "%s is %zu bytes long; at most %zu", spelled, strlen(text), o->size - 1);
        break;
    }
    v->s = text;
    v->has = 1;
    return FR_OK;
}

fr_status fr_opt_add_file(fr_opt_value *v, const char *file)
{
    const char **grown = realloc(v->list, sizeof *grown * (size_t)(v->n + 1));
    if (!grown) return fr_fail(FR_ENOMEM, "out of memory");
    v->list = grown;
    v->list[v->n++] = file;
    return FR_OK;
}

void fr_opt_value_clear(fr_opt_value *v)
{
    free(v->ids);
    free(v->list);
    memset(v, 0, sizeof *v);
}
