/* fp4rollout eval-kl: teacher-forced KL of KV cache configurations against a
 * BF16 KV cache (paper Appendix A), on the CPU decode path. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef FR_HAVE_CUDA
#include "rollout/model/runner_cuda.h"
#endif
#include "rollout/monitor/calibrate.h"
#include "app/cli.h"
#include "rollout/monitor/eval_kl.h"
#include "rollout/engine/session.h"
#include "app/tp_launch.h"

static const char usage_text[] =
    "usage: fp4rollout eval-kl --model M --texts FILE... [--calib FILE]\n"
    "                          [--configs LIST] [--ablation] [--tokens N] [--json]\n"
    "                          [--quiet] [--backend B] [--tp N] [--deterministic]\n"
    "\n"
    "Teacher-forced KL from a BF16 KV cache (paper Appendix A). Texts are raw bytes,\n"
    "read as BOS followed by one token per byte. A reference pass with a BF16 cache\n"
    "runs every text token by token through the decode path (cache writes and\n"
    "decode attention, one token of every text per step) and keeps its next-token\n"
    "distribution at every position; each configuration then runs the same tokens\n"
    "the same way. Per position, D = sum over the reference's top-128 tokens of\n"
    "p log(p / q) (Eq. 9); the table gives, per configuration, the mean D over each\n"
    "text's positions averaged over texts (in 1e-3 nats), the top-1 mismatch, the\n"
    "per-text means, and paired t statistics against a baseline: the first FP4\n"
    "configuration of the list with the same format (else the first FP4 one).\n"
    "t(texts) pairs per-text means (the paper's statistic); t(pos) pairs the D of\n"
    "each position (neighbouring positions are correlated, so it overstates\n"
    "significance; a guide when there are few texts).\n"
    "\n"
    "  --model M            checkpoint directory (or synthetic:tiny[:SEED])\n"
    "  --texts FILE...      evaluation texts: every argument up to the next option\n"
    "  --calib FILE         calibration file from fp4rollout calibrate (key mean,\n"
    "                       tau, FP8 scales); without it the key mean is zero, tau\n"
    "                       21/1024 and the FP8 scales 1 (a warning says so)\n"
    "  --configs LIST       comma-separated configurations (default\n"
    "                       " FR_EVAL_DEFAULT_CONFIGS ")\n"
    "  --ablation           the leave-one-out ablation (paper Table 8): every nvfp4\n"
    "                       or mxfp4 entry of the list (default nvfp4) is followed\n"
    "                       by its six -no-X variants\n"
    "  --tokens N           use only the first N tokens of each text (BOS included;\n"
    "                       default: whole texts, up to the context window)\n"
    "  --json               one JSON object per configuration instead of the table\n"
    "  --quiet              no progress on stderr\n"
    "  --backend B          auto (default: cuda when a GPU is present), cpu or cuda;\n"
    "                       on cuda every pass (reference included) runs the GPU\n"
    "                       kernels, and the default list leaves out f32 (CPU only)\n"
    "  --tp N               tensor parallel over N ranks (CPU backend; launch with\n"
    "                       mpirun -np N, or a multiple: every engine evaluates, world\n"
    "                       rank 0 prints; docs/tensor_parallel.md)\n"
    "  --deterministic      every text's figures bitwise the same whatever other\n"
    "                       texts are evaluated beside it, at any BLAS thread count\n"
    "                       or x86-64 CPU (CPU backend; --backend auto then picks the\n"
    "                       CPU; docs/determinism.md)\n"
    "\n"
    "configurations:\n"
    "  bf16                 BF16 KV: the reference rerun (0 on this deterministic path)\n"
    "  f32                  float32 KV, nothing rounded\n"
    "  fp8                  FP8 E4M3 KV with per-head K and V scales (from --calib)\n"
    "  nvfp4, mxfp4         FP4 KV, full recipe, exact compute (FP4 dual-residual\n"
    "                       query, FP4 probabilities with underflow-aware scaling)\n"
    "  nvfp4-vanilla        plain amax/6 (MXFP4: OCP scale) on every token, no\n"
    "                       smoothing or rotation, single FP4 query, plain P\n"
    "  nvfp4-kv             full recipe, bf16 compute: query and P kept in BF16\n"
    "  nvfp4-no-X           full recipe without part X: smooth (key mean), rotate\n"
    "                       (Hadamard), search (block-scale search), dual (dual-\n"
    "                       residual query), pscale (underflow-aware P scaling),\n"
    "                       sink (BF16 sink and recent tokens); several -no-X may\n"
    "                       follow each other, and every name works with mxfp4\n";

static void print_num(double x, const char *fmt)
{
    if (isfinite(x)) printf(fmt, x);
    else printf("null");
}

static void print_json_string(const char *s)
{
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20) printf("\\u%04x", *p);
        else putchar(*p);
    }
    putchar('"');
}

static void print_json(const fr_eval_kl_report *r, const char *model, const char *calib)
{
    for (int c = 0; c < r->n_configs; c++) {
        const fr_eval_result *res = &r->results[c];
        char desc[160], recipe[96];
        if (r->latent) fr_eval_config_describe_latent(&res->cfg, desc, (int)sizeof desc);
        else fr_eval_config_describe(&res->cfg, desc, (int)sizeof desc);
        fr_recipe_format(&res->cfg.recipe, recipe, (int)sizeof recipe);
        printf("{\"config\":\"%s\",\"description\":\"%s\",\"kv\":\"%s\",\"compute\":\"%s\",\"recipe\":\"%s\","
               "\"model\":", res->cfg.name, desc, fr_kv_dtype_name(res->cfg.kv),
               fr_fp4_compute_name(res->cfg.compute), recipe);
        print_json_string(model);
        printf(",\"calib\":");
        if (calib) print_json_string(calib);
        else printf("null");
        printf(",\"texts\":%d,\"positions\":%ld,\"kl_1e3\":", r->n_texts, r->positions);
        print_num(1e3 * res->kl, "%.6g");
        printf(",\"top1_mismatch_pct\":");
        print_num(100.0 * res->top1_mismatch, "%.6g");
        printf(",\"text_kl_1e3\":[");
        for (int i = 0; i < r->n_texts; i++) {
            printf(i ? "," : "");
            print_num(1e3 * res->text_kl[i], "%.6g");
        }
        printf("],\"text_top1_mismatch_pct\":[");
        for (int i = 0; i < r->n_texts; i++) {
            printf(i ? "," : "");
            print_num(100.0 * res->text_mismatch[i], "%.6g");
        }
        printf("],\"baseline\":");
        if (res->baseline >= 0) printf("\"%s\"", r->results[res->baseline].cfg.name);
        else printf("null");
        printf(",\"t_text\":");
        print_num(res->t_text, "%.6g");
        printf(",\"t_pos\":");
        print_num(res->t_pos, "%.6g");
        printf(",\"seconds\":%.3f}\n", res->seconds);
    }
}

static void print_t(double t)
{
    if (isfinite(t)) printf(" %.1f |", t);
    else printf(" - |");
}

static void print_table(const fr_eval_kl_report *r, const char *model, const char *calib, const fr_calib *c)
{
    printf("Teacher-forced KL(BF16 KV || configuration) over the reference's top-128 tokens\n");
    printf("model %s; %d texts, %ld positions; calibration: %s", model, r->n_texts, r->positions,
           calib ? calib : "none");
    if (calib) printf(" (tau %.7g)", c->tau);
    printf("; reference pass %.1f s\n\n", r->seconds_reference);
    printf("| configuration | what | KL (1e-3) | top-1 mismatch %% | baseline | t (texts) | t (pos) | "
           "per-text KL (1e-3) | time s |\n|---|---|---|---|---|---|---|---|---|\n");
    for (int k = 0; k < r->n_configs; k++) {
        const fr_eval_result *res = &r->results[k];
        char desc[160];
        if (r->latent) fr_eval_config_describe_latent(&res->cfg, desc, (int)sizeof desc);
        else fr_eval_config_describe(&res->cfg, desc, (int)sizeof desc);
        printf("| %s | %s | %.3f | %.2f | %s |", res->cfg.name, desc, 1e3 * res->kl, 100.0 * res->top1_mismatch,
               res->baseline == k ? "(itself)" : res->baseline >= 0 ? r->results[res->baseline].cfg.name : "-");
        print_t(res->t_text);
        print_t(res->t_pos);
        printf(" ");
        for (int i = 0; i < r->n_texts; i++) printf("%s%.3f", i ? " " : "", 1e3 * res->text_kl[i]);
        printf(" | %.1f |\n", res->seconds);
    }
}

/* The options of this command (app/cli_args.c reads them with getopt_long). */
static const struct option own_opts[] = {
    {"texts", required_argument, 0, 0}, {"model", required_argument, 0, 0},
    {"calib", required_argument, 0, 0}, {"configs", required_argument, 0, 0},
    {"tokens", required_argument, 0, 0}, {"ablation", no_argument, 0, 0}, {"json", no_argument, 0, 0},
    {"quiet", no_argument, 0, 0}, {"backend", required_argument, 0, 0}, {"tp", required_argument, 0, 0},
    {"deterministic", no_argument, 0, 0}, {0, 0, 0, 0},
};

int fr_cli_eval_kl(int argc, char **argv)
{
    const char *cmd = "eval-kl", *model = NULL, *calib_path = NULL, *configs = NULL;
    int tokens = 0, ablation = 0, json = 0, verbose = 1, tp = 1, deterministic = 0;
    const char *backend = "auto";
    if (fr_cli_wants_help(argc, argv)) {
        printf("%s", usage_text);
        return 0;
    }
    if (fr_cli_args(cmd, &argc, &argv, (const struct option *const[]){own_opts, NULL})) return 2;
    const char **files = calloc((size_t)argc, sizeof *files);
    int n_files = 0;
    if (!files) return fr_cli_usage_error(cmd, "out of memory");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--texts") == 0) {
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) files[n_files++] = argv[++i];
        } else if (strcmp(a, "--model") == 0 && v) model = argv[++i];
        else if (strcmp(a, "--calib") == 0 && v) calib_path = argv[++i];
        else if (strcmp(a, "--configs") == 0 && v) configs = argv[++i];
        else if (strcmp(a, "--tokens") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 1, 1 << 24, &tokens);
        else if (strcmp(a, "--ablation") == 0) ablation = 1;
        else if (strcmp(a, "--json") == 0) json = 1;
        else if (strcmp(a, "--quiet") == 0) verbose = 0;
        else if (strcmp(a, "--deterministic") == 0) deterministic = 1;
        else if (strcmp(a, "--backend") == 0 && v) backend = argv[++i];
        else if (strcmp(a, "--tp") == 0 && v) bad = fr_cli_int(cmd, a, argv[++i], 1, 1024, &tp);
        else { free(files); return fr_cli_usage_error(cmd, "unknown or incomplete option '%s'", a); }
        if (bad) { free(files); return 2; }
    }
    fr_eval_config *cfgs = NULL;
    int n_cfgs = 0, rc = 0, on_gpu = 0;
    fr_backend want = FR_BACKEND_AUTO, picked = FR_BACKEND_CPU;
    if (strcmp(backend, "cuda") == 0) want = FR_BACKEND_CUDA;
    else if (strcmp(backend, "cpu") == 0) want = FR_BACKEND_CPU;
    else if (strcmp(backend, "auto") != 0) {
        free(files);
        return fr_cli_usage_error(cmd, "unknown backend '%s' (expected auto, cpu or cuda)", backend);
    }
    if (deterministic && want == FR_BACKEND_CUDA) {
        free(files);
        return fr_cli_usage_error(cmd, "--deterministic runs on the CPU backend only so far (--backend cpu)");
    }
    if (deterministic) want = FR_BACKEND_CPU;   /* auto: the backend that has the mode */
    if (fr_backend_pick(want, &picked)) {
        free(files);
        return fr_cli_usage_error(cmd, "%s", fr_last_error());
    }
    on_gpu = picked == FR_BACKEND_CUDA;
    if (tp > 1 && want == FR_BACKEND_CUDA) {
        free(files);
        return fr_cli_usage_error(cmd, "--tp %d: eval-kl runs tensor parallel on the CPU backend (--backend cpu)", tp);
    }
    if (tp > 1) on_gpu = 0;
    if (on_gpu && !configs) configs = "fp8,nvfp4,nvfp4-vanilla,nvfp4-kv,mxfp4,mxfp4-vanilla,mxfp4-kv";
    if (!model) rc = fr_cli_usage_error(cmd, "--model is required");
    else if (n_files == 0) rc = fr_cli_usage_error(cmd, "--texts needs at least one file");
    else if (fr_eval_config_list(configs, ablation, &cfgs, &n_cfgs))
        rc = fr_cli_usage_error(cmd, "%s", fr_last_error());
    if (rc) { free(files); return rc; }

    fr_tp_launch tl;
    if (fr_tp_launch_open(tp, &tl)) {
        fprintf(stderr, "fp4rollout eval-kl: %s\n", fr_last_error());
        free(files); free(cfgs);
        return 1;
    }
    const fr_tp rank = {.rank = tl.group ? tl.group->layout.tp_rank : 0, .size = tp, .group = tl.group};
    if (!tl.output_rank) verbose = 0;
    fr_model *m = NULL;
    fr_calib calib = {0};
    int has_calib = 0;
    int **texts = calloc((size_t)n_files, sizeof *texts), *lens = calloc((size_t)n_files, sizeof(int));
    fr_eval_kl_report rep = {0};
    fr_status st = texts && lens ? FR_OK : fr_fail(FR_ENOMEM, "out of memory");
    if (!st) st = fr_model_load(model, &m);
    for (int i = 0; i < n_files && !st; i++) st = fr_byte_text_read(&m->cfg, files[i], tokens, &texts[i], &lens[i]);
    if (!st && calib_path && !(st = fr_calib_load(calib_path, fr_model_calib_dims(&m->cfg), &calib))) has_calib = 1;
    if (!st && !has_calib && tl.output_rank) {
        int fp4 = 0, fp8 = 0;
        for (int i = 0; i < n_cfgs; i++) {
            fp4 |= fr_kv_dtype_is_fp4(cfgs[i].kv) && cfgs[i].recipe.smooth;
            fp8 |= cfgs[i].kv == FR_KV_FP8;
        }
        if (fp4) fprintf(stderr, "fp4rollout eval-kl: warning: no --calib: the key mean is zero (no smoothing) "
                                 "and tau the default 21/1024\n");
        if (fp8) fprintf(stderr, "fp4rollout eval-kl: warning: no --calib: FP8 scales are 1.0\n");
    }
    if (!st && has_calib && !calib.fp8_scales && tl.output_rank)
        for (int i = 0; i < n_cfgs; i++)
            if (cfgs[i].kv == FR_KV_FP8) {
                fprintf(stderr, "fp4rollout eval-kl: warning: %s has no fp8_scales: FP8 scales are 1.0\n",
                        calib_path);
                break;
            }
    struct fr_weights_gpu *gpu = NULL;
#ifdef FR_HAVE_CUDA
    if (!st && on_gpu) st = fr_weights_gpu_from_model(m, &gpu);
#endif
    if (!st) {
        fr_eval_kl_params p = {.n_texts = n_files, .texts = (const int *const *)texts, .lens = lens,
                               .configs = cfgs, .n_configs = n_cfgs, .calib = has_calib ? &calib : NULL,
                               .verbose = verbose, .gpu = gpu, .tp = &rank, .deterministic = deterministic};
        st = fr_eval_kl(m, &p, &rep);
    }
#ifdef FR_HAVE_CUDA
    fr_weights_gpu_destroy(&gpu);
#endif
    if (!st && json && tl.output_rank) print_json(&rep, model, has_calib ? calib_path : NULL);
    if (!st && !json && tl.output_rank) print_table(&rep, model, has_calib ? calib_path : NULL, &calib);
    if (st) fprintf(stderr, "fp4rollout eval-kl: %s\n", fr_last_error());
    fr_eval_kl_report_free(&rep);
    for (int i = 0; texts && i < n_files; i++) free(texts[i]);
    free(texts); free(lens); free(files); free(cfgs);
    if (has_calib) fr_calib_free(&calib);
    fr_model_destroy(&m);
    fflush(stdout);
    fr_tp_launch_close(&tl);
    return st ? 1 : 0;
}
