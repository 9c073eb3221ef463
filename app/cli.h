/* The fp4rollout command line: one binary, one subcommand per job. Each
 * subcommand is a function taking its own argv (argv[0] = its name) and
 * returning the process exit status; each prints its usage on --help. */
#ifndef FR_CLI_H
#define FR_CLI_H

#include <stdio.h>

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

/* Small helpers so every subcommand parses and reports the same way. */

/* True when argv holds -h or --help. */
int fr_cli_wants_help(int argc, char **argv);
/* Parses a whole decimal int in [lo, hi]; on failure prints
 * "fp4rollout CMD: --flag expects ..." and returns -1. */
int fr_cli_int(const char *cmd, const char *flag, const char *text, long lo, long hi, int *out);
int fr_cli_float(const char *cmd, const char *flag, const char *text, float *out);

/* The sampling options generate and rollout share: --n, --max-tokens,
 * --greedy, --temperature, --top-p, --top-k, --seed, --stop-ids,
 * --ignore-eos, --json. */
typedef struct {
    int n_samples, max_tokens, json, ignore_eos, greedy;
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
/* The usage lines of the engine options. */
extern const char fr_engine_opts_usage[];
/* Prints "fp4rollout CMD: message" and a hint to --help; returns exit status 2. */
int fr_cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#ifdef __cplusplus
}
#endif

#endif
