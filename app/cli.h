/* The fp4rollout command line: one binary, one subcommand per job. Each
 * subcommand is a function taking its own argv (argv[0] = its name) and
 * returning the process exit status: 0 done, 1 a runtime failure, 2 a
 * usage error (app/README.md, "Command-line conventions"). Every option
 * comes from the option table (app/options.h): fr_cli_parse reads a
 * command's argv into its values, and --help lists them. */
#ifndef FR_CLI_H
#define FR_CLI_H

#include <signal.h>
#include <stdio.h>

#include "app/options.h"
#include "app/tp_launch.h"
#include "base/buf.h"
#include "rollout/model/sampler.h"
#include "rollout/engine/session.h"
#include "rollout/engine/stop_strings.h"
#include "tokenizer/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The release, printed by --version. */
#define FR_VERSION "0.9.0"

typedef struct fr_cli_values fr_cli_values;   /* below, "reading a command line" */

typedef struct {
    const char *name;
    fr_cmd cmd;
    const char *summary;
    const char *usage;     /* the --help text above the option list */
    int (*run)(const fr_cli_values *v);   /* after fr_cli_parse read its command line into v */
} fr_cli_command;

/* fp4rollout's commands, in the order its --help lists them. */
extern const fr_cli_command fr_cli_commands[];
extern const int fr_cli_n_commands;

int fr_cli_quant(const fr_cli_values *v);
int fr_cli_demo(const fr_cli_values *v);
int fr_cli_score(const fr_cli_values *v);
int fr_cli_generate(const fr_cli_values *v);
int fr_cli_calibrate(const fr_cli_values *v);
int fr_cli_eval_kl(const fr_cli_values *v);
int fr_cli_eval_task(const fr_cli_values *v);
int fr_cli_rollout(const fr_cli_values *v);
int fr_cli_serve(const fr_cli_values *v);
int fr_cli_dashboard(const fr_cli_values *v);
int fr_cli_tokenize(const fr_cli_values *v);
int fr_cli_detokenize(const fr_cli_values *v);
extern const char fr_quant_usage[], fr_demo_usage[], fr_score_usage[], fr_generate_usage[], fr_calibrate_usage[],
    fr_eval_kl_usage[], fr_eval_task_usage[], fr_rollout_usage[], fr_serve_usage[], fr_dashboard_usage[], fr_tokenize_usage[],
    fr_detokenize_usage[];

/* ---- reading a command line ---------------------------------------------- */

/* A command's options, each given or at its row's default, and the
 * arguments that are not options. */
struct fr_cli_values {
    fr_cmd cmd;
    fr_opt_value v[FR_O_COUNT];
    const char *spelled[FR_O_COUNT];   /* the name or alias written, for messages */
    const char **operands;
    int n_operands;
    int next;                          /* fr_cli_parse_head: argv's index of the first operand */
    struct fr_cli_values *held;        /* the values fr_cli_args_release frees */
};

/* Reads argv (argv[0] the command's name) with getopt_long against the
 * table's options of cmd: `--opt value` and `--opt=value` alike, an
 * unambiguous prefix of a name, vLLM's aliases; --log-level is applied.
 * Then checks the required options and the operands. Returns 0 with *out
 * set, or 1 when the command must return *rc at once: 0 after --help
 * (usage, then the option list), 2 after a usage error, printed with the
 * option and the reason. *out lives until fr_cli_args_release (main's,
 * after the command returns). */
int fr_cli_parse(fr_cmd cmd, const char *usage, int argc, char **argv, fr_cli_values **out, int *rc);
/* The same for the options before a command word (fp4rollout-client's
 * global options): reading stops at the first operand, whose index goes
 * to (*out)->next. No --help here: the caller looks for it first. */
int fr_cli_parse_head(fr_cmd cmd, int argc, char **argv, fr_cli_values **out, int *rc);
void fr_cli_args_release(void);

/* A value of the command's options; for rows not given, the default. */
int fr_opt_given(const fr_cli_values *v, fr_opt_id id);
int fr_opt_int(const fr_cli_values *v, fr_opt_id id);
long long fr_opt_long(const fr_cli_values *v, fr_opt_id id);
double fr_opt_num(const fr_cli_values *v, fr_opt_id id);
const char *fr_opt_str(const fr_cli_values *v, fr_opt_id id);   /* NULL: none */
const fr_opt_value *fr_opt_val(const fr_cli_values *v, fr_opt_id id);

/* --help: usage, then cmd's options from the table, under headings
 * ("options:", "engine options:") that title begins ("generate "), with
 * --help and --log-level when with_common. */
void fr_cli_help(FILE *out, fr_cmd cmd, const char *usage);
void fr_cli_print_options(FILE *out, fr_cmd cmd, const char *title, int with_common);
/* Writes text from column at, its words wrapped before column 80 onto
 * lines indented by indent, and ends the line. */
void fr_cli_wrap(FILE *out, const char *text, int at, int indent);

/* Prints "PROGRAM CMD: message" and a pointer to --help; returns 2. */
int fr_cli_usage_error(fr_cmd cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints "PROGRAM CMD: " and fr_last_error(), with the pointer to --help
 * when status is 2; returns status. */
int fr_cli_fail(fr_cmd cmd, int status);

/* ---- what several commands share ------------------------------------------- */

/* The sampling options of generate and rollout (the table's group
 * FR_OG_SAMPLING) with --json. */
typedef struct {
    int n_samples, max_tokens, json, ignore_eos;
    int min_tokens, logprobs, prompt_logprobs;   /* rollout/engine/request.h's options */
    int return_routed_experts;
    int first_sample;               /* samples are numbered first_sample, ...: stream i of the seed */
    const int *stop;                /* --stop-ids (n_stop of them), or NULL */
    int n_stop;
    fr_sampling_params sp;          /* seed: --seed's, or a fresh one from the operating system */
} fr_cli_sampling;
/* Fills o from the values and checks them together (--greedy against
 * --temperature, --min-tokens against --max-tokens). Without --seed the
 * seed comes from the operating system (several ranks then agree on rank
 * 0's with fr_tp_launch_agree_seed). Returns 0, or the exit status after
 * printing why (2 for bad usage, 1 when no seed could be drawn). */
int fr_cli_sampling_get(fr_cmd cmd, const fr_cli_values *v, fr_cli_sampling *o);
/* The model's EOS ids as the stop list when --stop-ids and --ignore-eos
 * are both absent: *owned (malloc'ed, the caller frees it) then holds them. */
fr_status fr_cli_default_stops(const fr_model_config *mc, fr_cli_sampling *o, int **owned);

/* Starts the ranks of a job of tp ranks per engine (app/tp_launch.h): 0,
 * or the exit status after printing why: 2 when the world does not fit
 * tp (mpirun -np against --tp), 1 when MPI fails. */
int fr_cli_launch(fr_cmd cmd, int tp, fr_tp_launch *l);

/* The engine options (rollout/engine/session.h's fr_engine_opts) of the
 * values: the defaults with the bundled demo model, then what was given. */
void fr_cli_engine_opts_get(const fr_cli_values *v, fr_engine_opts *o);
/* For programs outside the table's commands (bench/decode_step): consumes
 * argv[*i] (and its value) when it is an engine option: 1 when consumed,
 * 0 when not one, -1 after printing "CMD: --opt ..." on stderr. */
int fr_engine_opts_parse(const char *cmd, int argc, char **argv, int *i, fr_engine_opts *o);
/* The engine's defaults, with the bundled demo model (models/demo beside
 * the program's build folder) as the model. */
void fr_cli_engine_opts_default(fr_engine_opts *o);
const char *fr_cli_demo_model(void);
/* Whether the model is byte-level (ids 0-255 are bytes, 256 is BOS: the
 * demo model and the test models), so its tokenizer is the built-in one
 * (fr_tokenizer_bytes). */
int fr_cli_byte_model(const fr_model_config *mc);

/* fr_read_ids_file, with the system's reason when the file cannot be read. */
fr_status fr_cli_ids_file(const char *path, int **ids, int *n);

/* A file of prompts: one a line, comma-separated token ids or a JSON
 * string (the prompt's text), blank lines skipped. FR_EIO when it cannot
 * be read (with the system's reason), FR_EINVAL naming the line of a
 * malformed one or a file without prompts. */
typedef struct {
    int **ids;             /* ids[i]: prompt i's ids (len[i]), or NULL when it is text */
    int *len;
    char **text;           /* text[i]: prompt i's text (NUL-terminated), or NULL */
    int n, cap;
} fr_cli_prompts;
fr_status fr_cli_prompts_read(const char *path, fr_cli_prompts *p);
void fr_cli_prompts_free(fr_cli_prompts *p);

/* The JSON keys of the log-prob options, appended to a sample's object:
 * ,"top_logprobs":[[[id,logprob],...],...] (one list per token, best first)
 * when top_k > 0, and ,"prompt_logprobs":[null,lp1,...] (one entry per
 * prompt token) when plp is non-NULL. */
void fr_cli_json_logprobs(fr_buf *b, int top_k, const int *ids, const float *lps, int n_tokens, const float *plp,
                          int n_plp);
/* ,"routed_experts":[[[id,...],...],...] when ids is non-NULL: per token a
 * list per MoE layer of its k expert ids (n_tokens records of layers x k
 * ids, each width bytes, little endian: rollout/engine/request.h). */
void fr_cli_json_routes(fr_buf *b, const uint8_t *ids, int n_tokens, int layers, int k, int width);

/* ---- text (cli_text.c) ------------------------------------------------------ */

/* The tokenizer of an engine command's model (docs/tokenizer.md, "Where
 * text enters"). */
typedef struct {
    fr_tokenizer *tok;     /* NULL: the model takes token ids only (why says why) */
    char name[4200];       /* where it came from: --tokenizer's path, the folder, or "byte-level" */
    char why[768];         /* without one: the reason, for refusals of text */
    int bytes;             /* the built-in byte-level one: text files keep being read as bytes */
} fr_cli_text;
/* --tokenizer PATH when given (a file that cannot be loaded is a failure,
 * 1; a vocabulary that does not fit the model's a usage error, 2), else
 * the checkpoint folder's tokenizer.json (when it cannot be used, ids
 * still work and text is refused, saying why), else the built-in
 * byte-level tokenizer for byte-level models, else none. Reads the model's
 * config.json (not its weights). 0, or the exit status after printing why. */
int fr_cli_text_open(fr_cmd cmd, const char *model, const char *tokenizer_path, fr_cli_text *t);
void fr_cli_text_close(fr_cli_text *t);
/* The tokenizer text files go through (calibrate, eval-kl, recalibration):
 * NULL for byte-level models and models without one, whose files are read
 * as bytes, as they always were. */
static inline const fr_tokenizer *fr_cli_text_for_files(const fr_cli_text *t) { return t->bytes ? NULL : t->tok; }
/* The refusal of text (FR_EINVAL) for a model without a tokenizer; what
 * names what asked ("--prompt"). */
fr_status fr_cli_text_none(const fr_cli_text *t, const char *what);
/* text[0, len) as the model's ids, the tokenizer's special tokens added (a
 * BOS): malloc'ed *ids. FR_EINVAL naming `what` without a tokenizer, for
 * empty text, text over 16 MiB, text that is not UTF-8 or encodes to none. */
fr_status fr_cli_text_encode(const fr_cli_text *t, const char *what, const char *text, size_t len, int **ids, int *n);
/* The bytes of a file ("-": standard input), at most 16 MiB and a chunk
 * more: malloc'ed, NUL-terminated. */
fr_status fr_cli_read_text(const char *path, char **text, size_t *len);
/* ,"key":"..." with s[0, n) escaped for JSON (UTF-8 kept as it is). */
void fr_cli_json_string(fr_buf *b, const char *key, const char *s, size_t n);
/* The prompt of generate and score: --prompt or --prompt-text-file (text
 * through t), --prompt-ids, --prompt-file (ids), or def (ids; NULL: one of
 * them is required). *ids points into the values or at *owned, which the
 * caller frees. 0, or the exit status after printing why: 2 for the
 * command line (two prompts, text without a tokenizer, --prompt's text
 * refused), 1 for a file that cannot be read or whose text is refused. */
int fr_cli_read_prompt(fr_cmd cmd, const fr_cli_values *v, const fr_cli_text *t, const char *def, const int **ids,
                       int *n, int **owned);
/* The stop strings of --stop (FILES row id) and --include-stop-str-in-output,
 * pointing into the values; FR_EINVAL for one the engine would refuse. */
fr_status fr_cli_stops_of(const fr_cli_values *v, fr_opt_id id, int include, fr_stop_strings *out);

/* From now on SIGINT and SIGTERM set the flag returned (0 until then):
 * how a long-running command learns to stop. */
volatile sig_atomic_t *fr_cli_catch_stop(void);

#ifdef __cplusplus
}
#endif

#endif
