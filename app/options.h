/* The one table of the options of both programs (fp4rollout and
 * fp4rollout-client) and of the keys of the serve configuration
 * (app/options.def, one row each). Everything else is derived from it: the
 * getopt_long tables of every command (app/cli_parse.c), every command's
 * --help (app/cli_help.c), the serve configuration's reader, defaults and
 * JSON writer (app/serve_keys.c, app/serve_config.c) and the serve flags,
 * which fill the configuration directly (app/serve_flags.c). app/README.md
 * describes the design and how to add an option. */
#ifndef FR_OPTIONS_H
#define FR_OPTIONS_H

#include <stddef.h>
#include <stdint.h>

#include "attention/kv_numerics.h"
#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every command of both programs; FR_CMD_CLIENT is fp4rollout-client's
 * options before its command word. */
typedef enum {
    FR_CMD_QUANT,
    FR_CMD_DEMO,
    FR_CMD_GENERATE,
    FR_CMD_SCORE,
    FR_CMD_CALIBRATE,
    FR_CMD_EVAL_KL,
    FR_CMD_EVAL_TASK,
    FR_CMD_ROLLOUT,
    FR_CMD_SERVE,
    FR_CMD_DASHBOARD,
    FR_CMD_TOKENIZE,
    FR_CMD_DETOKENIZE,
    FR_CMD_CLIENT,
    FR_CMD_C_HELLO,
    FR_CMD_C_STATS,
    FR_CMD_C_PAUSE,
    FR_CMD_C_RESUME,
    FR_CMD_C_GENERATE,
    FR_CMD_C_PUSH_WEIGHTS,
    FR_CMD_C_WATCH_METRICS,
    FR_CMD_C_KEYGEN,
    FR_CMD_C_SEND_RAW,
    FR_CMD_COUNT
} fr_cmd;

/* A set of commands, for a row's cmds and required. */
#define FR_IN(c) (1u << FR_CMD_##c)
#define FR_IN_ALL ((1u << FR_CMD_COUNT) - 1u)
/* The commands that run an engine and take the engine options. */
#define FR_IN_ENGINE (FR_IN(GENERATE) | FR_IN(SCORE) | FR_IN(ROLLOUT) | FR_IN(CALIBRATE) | FR_IN(SERVE))

/* The command's name as typed ("eval-kl"; "" for FR_CMD_CLIENT) and its
 * program ("fp4rollout" or "fp4rollout-client"). */
const char *fr_cmd_name(fr_cmd cmd);
const char *fr_cmd_program(fr_cmd cmd);
/* The most arguments other than options the command takes (quant: IN OUT). */
int fr_cmd_max_operands(fr_cmd cmd);

typedef enum {
    FR_OPT_FLAG,   /* no value on the command line; true or false in JSON (an int 0/1) */
    FR_OPT_INT,    /* a whole number in [lo, hi] (an int) */
    FR_OPT_LONG,   /* a whole number in [lo, hi] (a long long) */
    FR_OPT_NUM,    /* a number in [lo, hi], or (lo, hi] when lo_open (a double) */
    FR_OPT_FLOAT,  /* the same, kept as a float */
    FR_OPT_SEED,   /* any 64-bit seed; JSON numbers are exact to 2^53, so JSON takes those or null */
    FR_OPT_STR,    /* a non-empty string (JSON: null too when nullable, kept as "") */
    FR_OPT_CHOICE, /* a name that choice.parse reads into an int (an enum) */
    FR_OPT_RECIPE, /* an accuracy recipe, "full,-rotate" (fr_recipe) */
    FR_OPT_IDS,    /* token ids, "1,2,3" (JSON: an array of numbers) */
    FR_OPT_FILES,  /* file names: every argument up to the next option (JSON: an array) */
    FR_OPT_KEY,    /* a CURVE key: 40 characters of ZeroMQ's Z85 alphabet */
    FR_OPT_KEYS,   /* CURVE keys (JSON: an array) */
} fr_opt_type;

/* Where --help lists a row: a command's own options first, then the
 * sampling options, the engine options and those every command takes. */
typedef enum { FR_OG_OWN = 0, FR_OG_SAMPLING, FR_OG_ENGINE, FR_OG_COMMON } fr_opt_group;

typedef struct {
    fr_status (*parse)(const char *text, int *out);
    const char *(*name)(int value);   /* NULL where the value is never written back */
} fr_opt_choice;

typedef struct {
    const char *name;          /* the long name without "--"; NULL: a configuration key alone */
    char short_name;           /* -x, or 0 */
    const char *alias;         /* vLLM's name of the same option, or NULL */
    fr_opt_type type;
    fr_opt_group group;
    double lo, hi;             /* INT, LONG, NUM, FLOAT: the range; IDS: each id's */
    int lo_open;               /* NUM, FLOAT: (lo, hi] */
    int n_min, n_max;          /* IDS, FILES, KEYS: how many values (n_max 0: any number) */
    int nullable;              /* STR, SEED, KEY: JSON null is allowed and means none */
    int empty_ok;              /* STR: "" is a value (a text to tokenize), not a missing one */
    const char *def;           /* the default, as a command-line value; NULL: none */
    const char *def_note;      /* the default in words, where it is not one value ("the server's") */
    const char *meta;          /* the value's name in --help ("N", "FILE") */
    const char *help;          /* what it does; rows with a name must have it */
    uint32_t cmds;             /* FR_IN(...): the commands that take it */
    uint32_t required;         /* FR_IN(...): of those, the ones that require it */
    fr_opt_choice choice;      /* CHOICE */
    const char *key;           /* its serve configuration key ("coordinator.port"), or NULL */
    size_t at, size, count_at; /* with key: its place in fr_serve_config, the bytes of one value, and for
                                  IDS, FILES, KEYS the place of the count (SEED: of the has-seed flag) */
} fr_opt;

typedef enum {
#define FR_OPT(id, ...) FR_O_##id,
#include "app/options.def"
#undef FR_OPT
    FR_O_COUNT
} fr_opt_id;

extern const fr_opt fr_opts[FR_O_COUNT];

/* Whether the row is an option of cmd. */
int fr_opt_takes(const fr_opt *o, fr_cmd cmd);

/* One option's value, from the command line or JSON. Strings point into
 * argv or the JSON text; ids and list are malloc'ed (fr_opt_value_clear). */
typedef struct {
    int given;           /* written on the command line (or in the JSON) */
    long long i;         /* FLAG, INT, LONG, CHOICE */
    double d;            /* NUM, FLOAT */
    uint64_t u;          /* SEED */
    int has;             /* SEED, STR, KEY: 0 for JSON null (none) */
    const char *s;       /* STR, KEY */
    int *ids;            /* IDS: n of them */
    const char **list;   /* FILES, KEYS: n of them */
    int n;
    fr_recipe recipe;    /* RECIPE */
} fr_opt_value;

/* Reads text as the row's value (the command-line syntax). On failure,
 * FR_EINVAL with a message naming the option as spelled ("--max-num-seqs")
 * and the reason: "--n expects an integer in [1, 4096], got '0'". */
fr_status fr_opt_from_text(const fr_opt *o, const char *spelled, const char *text, fr_opt_value *v);
/* Adds a file to a FILES value (or a key to a KEYS value). */
fr_status fr_opt_add_file(fr_opt_value *v, const char *file);
/* Whether s is a CURVE key: 40 characters of ZeroMQ's Z85 alphabet. */
int fr_opt_z85_key(const char *s);
/* Frees what the value holds and zeroes it. */
void fr_opt_value_clear(fr_opt_value *v);
/* "an integer in [1, 4096]": what the row's values are, for messages. */
void fr_opt_describe(const fr_opt *o, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif
