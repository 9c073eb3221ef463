#include "app/cli.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "base/seed.h"

#include <unistd.h>

/* The bundled demo model is found from the program's own place (build/,
 * build/cpu/ or an installed bin/ below the tree), then from the working
 * directory, so it works without an install step or a variable. */
const char *fr_cli_demo_model(void)
{
    static char found[PATH_MAX + 16];
    if (found[0]) return found;
    char dir[PATH_MAX], probe[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    for (int up = 0; n > 0 && up < 4; up++) {
        dir[n] = '\0';
        char *slash = strrchr(dir, '/');
        if (!slash || slash == dir) break;
        *slash = '\0';
        n = slash - dir;
        snprintf(probe, sizeof probe, "%s/models/demo/config.json", dir);
        if (access(probe, R_OK) == 0) {
            snprintf(found, sizeof found, "%s/models/demo", dir);
            return found;
        }
    }
    snprintf(found, sizeof found, "models/demo");   /* the clear error then names it */
    return found;
}

int fr_cli_byte_model(const fr_model_config *mc)
{
    return mc->bos_id == 256 && mc->vocab_size > 256 && mc->vocab_size <= 512;
}

fr_status fr_cli_byte_prompt(const char *text, int **ids, int *n)
{
    size_t len = strlen(text);
    if (len > (1u << 24)) return fr_fail(FR_EINVAL, "--prompt: text longer than 16 MiB");
    int *out = malloc(sizeof(int) * (len + 1));
    if (!out) return fr_fail(FR_ENOMEM, "out of memory");
    out[0] = 256;   /* BOS */
    for (size_t i = 0; i < len; i++) out[i + 1] = (unsigned char)text[i];
    *ids = out;
    *n = (int)len + 1;
    return FR_OK;
}

void fr_cli_engine_opts_default(fr_engine_opts *o)
{
    fr_engine_opts_default(o);
    o->model = fr_cli_demo_model();
}

int fr_cli_wants_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) return 1;
    return 0;
}

const char *fr_cli_program = "fp4rollout";

int fr_cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s%s%s: ", fr_cli_program, *cmd ? " " : "", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(run '%s%s%s --help' for usage)\n", fr_cli_program, *cmd ? " " : "", cmd);
    return 2;
}

int fr_cli_int(const char *cmd, const char *flag, const char *text, long lo, long hi, int *out)
{
    char *end = NULL;
    errno = 0;
    long v = text ? strtol(text, &end, 10) : 0;
    if (!text || !*text || *end || errno || v < lo || v > hi) {
        fr_cli_usage_error(cmd, "%s expects an integer in [%ld, %ld], got '%s'", flag, lo, hi,
                           text ? text : "(nothing)");
        return -1;
    }
    *out = (int)v;
    return 0;
}

int fr_cli_float(const char *cmd, const char *flag, const char *text, float *out)
{
    char *end = NULL;
    errno = 0;
    float v = text ? strtof(text, &end) : 0.0f;
    if (!text || !*text || *end || errno) {
        fr_cli_usage_error(cmd, "%s expects a number, got '%s'", flag, text ? text : "(nothing)");
        return -1;
    }
    *out = v;
    return 0;
}

/* A log-prob as JSON: %.9g round-trips a float; -inf as -1e999 (which JSON
 * readers take as -infinity), NaN as null. */
static void json_logprob(fr_buf *b, float x)
{
    if (isfinite(x)) fr_buf_printf(b, "%.9g", (double)x);
    else if (x == -INFINITY) fr_buf_printf(b, "-1e999");
    else fr_buf_printf(b, "null");
}

void fr_cli_json_logprobs(fr_buf *b, int top_k, const int *ids, const float *lps, int n_tokens, const float *plp,
                          int n_plp)
{
    if (top_k > 0 && ids && lps) {
        fr_buf_printf(b, ",\"top_logprobs\":[");
        for (int i = 0; i < n_tokens; i++) {
            fr_buf_printf(b, "%s[", i ? "," : "");
            for (int k = 0; k < top_k; k++) {
                fr_buf_printf(b, "%s[%d,", k ? "," : "", ids[(size_t)i * top_k + k]);
                json_logprob(b, lps[(size_t)i * top_k + k]);
                fr_buf_printf(b, "]");
            }
            fr_buf_printf(b, "]");
        }
        fr_buf_printf(b, "]");
    }
    if (plp) {
        fr_buf_printf(b, ",\"prompt_logprobs\":[null");
        for (int i = 0; i < n_plp; i++) {
            fr_buf_printf(b, ",");
            json_logprob(b, plp[i]);
        }
        fr_buf_printf(b, "]");
    }
}

void fr_cli_sampling_default(fr_cli_sampling *o)
{
    *o = (fr_cli_sampling){.n_samples = 1, .max_tokens = 64,
                           .sp = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .seed = 0}};
}

/* Any 64-bit seed, so that a seed reported by a run or a server replays. */
static int parse_seed(const char *cmd, const char *text, fr_cli_sampling *o)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (!*text || *text == '-' || *text == '+' || *end || errno) {
        fr_cli_usage_error(cmd, "--seed expects an integer in [0, 2^64), got '%s'", text);
        return -1;
    }
    o->has_seed = 1;
    o->seed = (uint64_t)v;
    return 0;
}

int fr_cli_sampling_parse(const char *cmd, int argc, char **argv, int *i, fr_cli_sampling *o)
{
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    int bad = 0;
    if (strcmp(a, "--greedy") == 0) o->greedy = 1;
    else if (strcmp(a, "--json") == 0) o->json = 1;
    else if (strcmp(a, "--ignore-eos") == 0) o->ignore_eos = 1;
    else if (strcmp(a, "--prompt-logprobs") == 0) o->prompt_logprobs = 1;
    else if (!v) return 0;
    else if (strcmp(a, "--stop-ids") == 0) o->stop_text = argv[++*i];
    else if (strcmp(a, "--n") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 1, 4096, &o->n_samples);
    else if (strcmp(a, "--max-tokens") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 1, 1 << 24, &o->max_tokens);
    else if (strcmp(a, "--top-k") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 0, 1 << 30, &o->sp.top_k);
    else if (strcmp(a, "--seed") == 0) bad = parse_seed(cmd, argv[++*i], o);
    else if (strcmp(a, "--min-tokens") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 0, 1 << 24, &o->min_tokens);
    else if (strcmp(a, "--logprobs") == 0) bad = fr_cli_int(cmd, a, argv[++*i], 0, FR_MAX_TOP_LOGPROBS, &o->logprobs);
    else if (strcmp(a, "--first-sample") == 0)
        bad = fr_cli_int(cmd, a, argv[++*i], 0, INT_MAX - 4096, &o->first_sample);
    else if (strcmp(a, "--temperature") == 0) bad = fr_cli_float(cmd, a, argv[++*i], &o->sp.temperature);
    else if (strcmp(a, "--top-p") == 0) bad = fr_cli_float(cmd, a, argv[++*i], &o->sp.top_p);
    else return 0;
    return bad ? -1 : 1;
}

int fr_cli_sampling_finish(const char *cmd, fr_cli_sampling *o)
{
    if (o->greedy && o->sp.temperature > 0.0f) return fr_cli_usage_error(cmd, "--greedy contradicts --temperature");
    if (o->greedy) o->sp.temperature = 0.0f;
    if (o->min_tokens > o->max_tokens)
        return fr_cli_usage_error(cmd, "--min-tokens %d exceeds --max-tokens %d", o->min_tokens, o->max_tokens);
    if (!o->has_seed && fr_seed_from_os(&o->seed)) {
        fprintf(stderr, "fp4rollout %s: %s (give --seed)\n", cmd, fr_last_error());
        return 2;
    }
    o->sp.seed = o->seed;
    return 0;
}

const struct option fr_cli_sampling_longopts[] = {
    {"greedy", no_argument, 0, 0},      {"json", no_argument, 0, 0},         {"ignore-eos", no_argument, 0, 0},
    {"stop-ids", required_argument, 0, 0}, {"n", required_argument, 0, 0}, {"max-tokens", required_argument, 0, 0},
    {"top-k", required_argument, 0, 0}, {"seed", required_argument, 0, 0},  {"temperature", required_argument, 0, 0},
    {"top-p", required_argument, 0, 0}, {"first-sample", required_argument, 0, 0},
    {"min-tokens", required_argument, 0, 0}, {"logprobs", required_argument, 0, 0},
    {"prompt-logprobs", no_argument, 0, 0}, {0, 0, 0, 0},
};

const struct option fr_cli_engine_longopts[] = {
    {"deterministic", no_argument, 0, 0}, {"model", required_argument, 0, 0},   {"kv", required_argument, 0, 0},
    {"fp4-compute", required_argument, 0, 0}, {"recipe", required_argument, 0, 0}, {"calib", required_argument, 0, 0},
    {"chunk", required_argument, 0, 0},   {"backend", required_argument, 0, 0}, {"tp", required_argument, 0, 0},
    {"max-model-len", required_argument, 0, 0}, {0, 0, 0, 0},
};

const char fr_engine_opts_usage[] =
    "  --model M            checkpoint directory (default: the bundled demo model,\n"
    "                       models/demo), or synthetic:tiny[:SEED] (random weights);\n"
    "                       synthetic:qwen3-4b[:SEED] (Qwen3-4B's shape) on --backend cuda\n"
    "                       (synthetic:qwen3-4b-128k: the same with a 131,072-token window)\n"
    "                       (synthetic:qwen3-30b-a3b[-128k]: Qwen3-30B-A3B's MoE shape)\n"
    "  --backend B          auto (default: cuda when a GPU is present and supports\n"
    "                       the configuration, else cpu), cpu or cuda\n"
    "  --kv T               KV cache dtype: bf16 (default), fp8, nvfp4, mxfp4, or\n"
    "                       f32 (exact float32 storage, the CPU reference)\n"
    "  --fp4-compute C      auto (default: bf16 on CUDA, exact on the CPU), exact\n"
    "                       (FP4 query and probabilities, as native FP4 MMAs\n"
    "                       compute) or bf16 (unquantized query and P)\n"
    "  --recipe R           full (default) or vanilla, optionally followed by\n"
    "                       switches: full,-rotate,-search,-smooth,-dual,-pscale,-sink\n"
    "  --calib FILE         calibration file (key mean, tau) from fp4rollout calibrate\n"
    "  --chunk N            prefill chunk in tokens (default 512)\n"
    "  --max-model-len N    cap the context window (prompt plus new tokens) at N\n"
    "                       tokens, below the model's own (smaller buffers)\n"
    "  --tp N               tensor parallelism: ranks per engine (default 1); under\n"
    "                       mpirun -np W the ranks form W/N engines (CPU backend)\n"
    "  --deterministic      a sample's tokens and log-probs bitwise the same whatever\n"
    "                       else is in the batch, however its prompt is chunked, after\n"
    "                       preemption, on any engine, thread count or x86-64 CPU\n"
    "                       (CPU: f32 and bf16 KV; GPU: bf16 KV, and FP4/FP8 KV\n"
    "                       with the prompt's chunks unchanged; docs/determinism.md)\n";

int fr_engine_opts_parse(const char *cmd, int argc, char **argv, int *i, fr_engine_opts *o)
{
    const char *a = argv[*i];
    if (strcmp(a, "--deterministic") == 0) {
        o->deterministic = 1;
        return 1;
    }
    static const char *const flags[] = {"--model", "--kv", "--fp4-compute", "--recipe", "--calib", "--chunk",
                                        "--backend", "--tp", "--max-model-len"};
    int which = -1;
    for (int f = 0; f < 9; f++)
        if (strcmp(a, flags[f]) == 0) which = f;
    if (which < 0) return 0;
    if (*i + 1 >= argc) {
        fr_cli_usage_error(cmd, "%s needs a value", a);
        return -1;
    }
    const char *v = argv[++*i];
    fr_status st = FR_OK;
    switch (which) {
    case 0: o->model = v; break;
    case 1: st = fr_kv_dtype_parse(v, &o->kv); break;
    case 2: st = fr_fp4_compute_parse(v, &o->compute); break;
    case 3: st = fr_recipe_parse(v, &o->recipe); break;
    case 4: o->calib = v; break;
    case 5: return fr_cli_int(cmd, "--chunk", v, 1, 1 << 20, &o->chunk) ? -1 : 1;
    case 6:
        if (strcmp(v, "auto") == 0) o->backend = FR_BACKEND_AUTO;
        else if (strcmp(v, "cpu") == 0) o->backend = FR_BACKEND_CPU;
        else if (strcmp(v, "cuda") == 0) o->backend = FR_BACKEND_CUDA;
        else st = fr_fail(FR_EINVAL, "unknown backend '%s' (expected auto, cpu or cuda)", v);
        break;
    case 7: return fr_cli_int(cmd, "--tp", v, 1, 1024, &o->tp) ? -1 : 1;
    case 8: return fr_cli_int(cmd, "--max-model-len", v, 2, 1 << 30, &o->max_model_len) ? -1 : 1;
    }
    if (st) {
        fr_cli_usage_error(cmd, "%s", fr_last_error());
        return -1;
    }
    return 1;
}
