/* The fp4rollout command line: one binary, one subcommand per job. Each
 * subcommand is a function taking its own argv (argv[0] = its name) and
 * returning the process exit status; each prints its usage on --help. */
#ifndef FR_CLI_H
#define FR_CLI_H

#include <getopt.h>
#include <stdio.h>

#include "base/buf.h"
#include "rollout/model/sampler.h"
#include "rollout/engine/session.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *name;
    const char *summary;
    int (*run)(int argc, char **argv);
} fr_cli_command;

int fr_cli_quant(int argc, char **argv);
int fr_cli_demo(int argc, char **argv);
int fr_cli_score(int argc, char **argv);
int fr_cli_generate(int argc, char **argv);
int fr_cli_calibrate(int argc, char **argv);
int fr_cli_eval_kl(int argc, char **argv);
int fr_cli_rollout(int argc, char **argv);
int fr_cli_serve(int argc, char **argv);
int fr_cli_dashboard(int argc, char **argv);
int fr_cli_tokenize(int argc, char **argv);
int fr_cli_detokenize(int argc, char **argv);

/* Small helpers so every subcommand parses and reports the same way. */

/* The release, printed by --version. */
#define FR_VERSION "0.9.0"

/* Reads *argv with getopt_long against the options of tables (a
 * NULL-terminated list of arrays, each ended by a zeroed entry; flag and val
 * are not used), plus --log-level, which it applies, and vLLM's aliases of
 * known names (--kv-cache-dtype, --tensor-parallel-size, --max-num-seqs).
 * `--opt=value` and `--opt value` both work. On success replaces *argc and
 * *argv by a canonical argv: every option as "--full-name", then its value
 * when it takes one; other arguments in their places. Returns 0, or 2 after
 * printing the usage error. The canonical argv lives until
 * fr_cli_args_release (main's, after the subcommand returns). */
int fr_cli_args(const char *cmd, int *argc, char ***argv, const struct option *const *tables);
void fr_cli_args_release(void);
/* The same for the options before a command word (fp4rollout-client's
 * global options): parsing stops at the first operand, which and all after
 * it stay as they are. */
int fr_cli_args_head(const char *cmd, int *argc, char ***argv, const struct option *const *tables);
/* The program named in usage errors: "fp4rollout" unless set. */
extern const char *fr_cli_program;
/* The option tables of fr_engine_opts_parse and fr_cli_sampling_parse. */
extern const struct option fr_cli_engine_longopts[];
extern const struct option fr_cli_sampling_longopts[];

/* True when argv holds -h or --help. */
int fr_cli_wants_help(int argc, char **argv);
/* Parses a whole decimal int in [lo, hi]; on failure prints
 * "fp4rollout CMD: --flag expects ..." and returns -1. */
int fr_cli_int(const char *cmd, const char *flag, const char *text, long lo, long hi, int *out);
int fr_cli_float(const char *cmd, const char *flag, const char *text, float *out);

/* The sampling options generate and rollout share: --n, --max-tokens,
 * --greedy, --temperature, --top-p, --top-k, --seed, --first-sample,
 * --stop-ids, --ignore-eos, --min-tokens, --logprobs, --prompt-logprobs,
 * --json. */
typedef struct {
    int n_samples, max_tokens, json, ignore_eos, greedy;
    int min_tokens, logprobs, prompt_logprobs;   /* rollout/engine/request.h's options */
    int first_sample;               /* samples are numbered first_sample, ...: stream i of the seed */
    int has_seed;                   /* --seed given; else finish draws a fresh one */
    uint64_t seed;
    const char *stop_text;          /* --stop-ids, or NULL */
    fr_sampling_params sp;
} fr_cli_sampling;
void fr_cli_sampling_default(fr_cli_sampling *o);
/* Consumes argv[*i] (and its value) when it is a sampling option: 1 when
 * consumed, 0 when not one, -1 after printing an error. */
int fr_cli_sampling_parse(const char *cmd, int argc, char **argv, int *i, fr_cli_sampling *o);
/* After parsing: checks --greedy against --temperature and fills sp (seed:
 * --seed's, else a fresh one from the operating system, which several ranks
 * must then agree on with fr_tp_launch_agree_seed; temperature 0 when
 * greedy); returns 0, or 2 after printing an error. */
int fr_cli_sampling_finish(const char *cmd, fr_cli_sampling *o);
/* The engine options every engine command takes (--model, --backend, --kv,
 * ...; rollout/engine/session.h's fr_engine_opts). Consumes argv[*i] (and its
 * value) when it is one: returns 1 when consumed, 0 when not an engine
 * option, -1 after printing an error. */
int fr_engine_opts_parse(const char *cmd, int argc, char **argv, int *i, fr_engine_opts *o);
/* The engine's defaults, with the bundled demo model (models/demo beside
 * the program's build folder) as the model. */
void fr_cli_engine_opts_default(fr_engine_opts *o);
const char *fr_cli_demo_model(void);
/* Whether the model is byte-level (ids 0-255 are bytes, 256 is BOS: the
 * demo model and the test models), so text maps to ids without a tokenizer. */
int fr_cli_byte_model(const fr_model_config *mc);
/* BOS, then the bytes of text: *ids malloc'ed, the caller frees it. */
fr_status fr_cli_byte_prompt(const char *text, int **ids, int *n);
/* The usage lines of the engine options. */
extern const char fr_engine_opts_usage[];
/* The JSON keys of the log-prob options, appended to a sample's object:
 * ,"top_logprobs":[[[id,logprob],...],...] (one list per token, best first)
 * when top_k > 0, and ,"prompt_logprobs":[null,lp1,...] (one entry per
 * prompt token) when plp is non-NULL. */
void fr_cli_json_logprobs(fr_buf *b, int top_k, const int *ids, const float *lps, int n_tokens, const float *plp,
                          int n_plp);
/* Prints "fp4rollout CMD: message" and a hint to --help; returns exit status 2. */
int fr_cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#ifdef __cplusplus
}
#endif

#endif
