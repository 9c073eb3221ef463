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

const char fr_eval_kl_usage[] =
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
    "On --backend cuda every pass (reference included) runs the GPU kernels, and\n"
    "the default list leaves out f32 (CPU only). --tp N runs tensor parallel over\n"
    "N ranks on the CPU backend (launch with mpirun -np N, or a multiple: every\n"
    "engine evaluates, world rank 0 prints; docs/tensor_parallel.md).\n"
    "--deterministic makes every text's figures bitwise the same whatever other\n"
    "texts are evaluated beside it, at any BLAS thread count or x86-64 CPU (CPU\n"
    "backend; --backend auto then picks the CPU; docs/determinism.md). --json\n"
    "prints one JSON object per configuration instead of the table.\n"
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

/* The backend and the configurations: 0, or the exit status after
 * printing why they cannot go together. */
static int pick(fr_cmd cmd, const fr_cli_values *v, int *on_gpu, fr_eval_config **cfgs, int *n_cfgs)
{
    const int tp = fr_opt_int(v, FR_O_TP), deterministic = fr_opt_int(v, FR_O_DETERMINISTIC);
    fr_backend want = (fr_backend)fr_opt_int(v, FR_O_BACKEND), picked = FR_BACKEND_CPU;
    if (deterministic && want == FR_BACKEND_CUDA)
        return fr_cli_usage_error(cmd, "--deterministic runs on the CPU backend only so far (--backend cpu)");
    if (tp > 1 && want == FR_BACKEND_CUDA)
        return fr_cli_usage_error(cmd, "--tp %d: eval-kl runs tensor parallel on the CPU backend (--backend cpu)", tp);
    if (deterministic) want = FR_BACKEND_CPU;   /* auto: the backend that has the mode */
    if (fr_backend_pick(want, &picked)) return fr_cli_fail(cmd, 2);
    *on_gpu = picked == FR_BACKEND_CUDA && tp == 1;
    const char *configs = fr_opt_str(v, FR_O_CONFIGS);
    if (*on_gpu && !configs) configs = "fp8,nvfp4,nvfp4-vanilla,nvfp4-kv,mxfp4,mxfp4-vanilla,mxfp4-kv";
    if (fr_eval_config_list(configs, fr_opt_int(v, FR_O_ABLATION), cfgs, n_cfgs)) return fr_cli_fail(cmd, 2);
    return 0;
}

/* Without a calibration file the figures use zero key means, the default
 * tau and FP8 scales of 1: say so where a configuration depends on them. */
static void warn_calib(const fr_eval_config *cfgs, int n_cfgs, const fr_calib *calib, const char *calib_path)
{
    int fp4 = 0, fp8 = 0;
    for (int i = 0; i < n_cfgs; i++) {
        fp4 |= fr_kv_dtype_is_fp4(cfgs[i].kv) && cfgs[i].recipe.smooth;
        fp8 |= cfgs[i].kv == FR_KV_FP8;
    }
    if (!calib_path && fp4)
        fprintf(stderr, "fp4rollout eval-kl: warning: no --calib: the key mean is zero (no smoothing) and tau the "
                        "default 21/1024\n");
    if (!calib_path && fp8) fprintf(stderr, "fp4rollout eval-kl: warning: no --calib: FP8 scales are 1.0\n");
    if (calib_path && !calib->fp8_scales && fp8)
        fprintf(stderr, "fp4rollout eval-kl: warning: %s has no fp8_scales: FP8 scales are 1.0\n", calib_path);
}

/* One evaluation: the inputs loaded, every configuration run, the report printed. */
typedef struct {
    const fr_cli_values *v;
    const fr_tp_launch *tl;
    const fr_eval_config *cfgs;
    int n_cfgs, on_gpu;
    const fr_tokenizer *tok;   /* the texts' (NULL: bytes) */
} eval_run;

static fr_status evaluate(const eval_run *e, fr_model *m, int **texts, int *lens, fr_calib *calib)
{
    const fr_cli_values *v = e->v;
    const char *model = fr_opt_str(v, FR_O_MODEL), *calib_path = fr_opt_str(v, FR_O_CALIB);
    const fr_opt_value *files = fr_opt_val(v, FR_O_TEXTS);
    const int tp = fr_opt_int(v, FR_O_TP), tokens = fr_opt_given(v, FR_O_TOKENS) ? fr_opt_int(v, FR_O_TOKENS) : 0;
    fr_status st = FR_OK;
    for (int i = 0; i < files->n && !st; i++)
        st = fr_text_file_read(&m->cfg, e->tok, files->list[i], tokens, &texts[i], &lens[i]);
    if (!st && calib_path) st = fr_calib_load(calib_path, fr_model_calib_dims(&m->cfg), calib);
    if (!st && e->tl->output_rank) warn_calib(e->cfgs, e->n_cfgs, calib, calib_path);
    struct fr_weights_gpu *gpu = NULL;
#ifdef FR_HAVE_CUDA
    if (!st && e->on_gpu) st = fr_weights_gpu_from_model(m, &gpu);
#endif
    const fr_tp rank = {.rank = e->tl->group ? e->tl->group->layout.tp_rank : 0, .size = tp, .group = e->tl->group};
    fr_eval_kl_report rep = {0};
    if (!st) {
        fr_eval_kl_params p = {.n_texts = files->n, .texts = (const int *const *)texts, .lens = lens,
                               .configs = e->cfgs, .n_configs = e->n_cfgs, .calib = calib_path ? calib : NULL,
                               .verbose = e->tl->output_rank && !fr_opt_int(v, FR_O_QUIET), .gpu = gpu, .tp = &rank,
                               .deterministic = fr_opt_int(v, FR_O_DETERMINISTIC)};
        st = fr_eval_kl(m, &p, &rep);
    }
#ifdef FR_HAVE_CUDA
    fr_weights_gpu_destroy(&gpu);
#endif
    if (!st && e->tl->output_rank) {
        if (fr_opt_int(v, FR_O_JSON)) print_json(&rep, model, calib_path);
        else print_table(&rep, model, calib_path, calib);
    }
    fr_eval_kl_report_free(&rep);
    return st;
}

int fr_cli_eval_kl(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_EVAL_KL;
    fr_eval_config *cfgs = NULL;
    int n_cfgs = 0, on_gpu = 0, rc;
    if ((rc = pick(cmd, v, &on_gpu, &cfgs, &n_cfgs))) return rc;
    fr_tp_launch tl;
    if ((rc = fr_cli_launch(cmd, fr_opt_int(v, FR_O_TP), &tl))) {
        free(cfgs);
        return rc;
    }
    fr_cli_text tx;
    if ((rc = fr_cli_text_open(cmd, fr_opt_str(v, FR_O_MODEL), fr_opt_str(v, FR_O_MODEL_TOKENIZER), &tx))) {
        free(cfgs);
        fr_tp_launch_close(&tl);
        return rc;
    }
    const int n_files = fr_opt_val(v, FR_O_TEXTS)->n;
    int **texts = calloc((size_t)n_files, sizeof *texts), *lens = calloc((size_t)n_files, sizeof(int));
    fr_model *m = NULL;
    fr_calib calib = {0};
    fr_status st = texts && lens ? FR_OK : fr_fail(FR_ENOMEM, "out of memory");
    if (!st) st = fr_model_load(fr_opt_str(v, FR_O_MODEL), &m);
    const eval_run e = {.v = v, .tl = &tl, .cfgs = cfgs, .n_cfgs = n_cfgs, .on_gpu = on_gpu,
                        .tok = fr_cli_text_for_files(&tx)};
    if (!st) st = evaluate(&e, m, texts, lens, &calib);
    if (st) fr_cli_fail(cmd, 1);
    for (int i = 0; texts && i < n_files; i++) free(texts[i]);
    free(texts);
    free(lens);
    free(cfgs);
    fr_calib_free(&calib);
    fr_model_destroy(&m);
    fr_cli_text_close(&tx);
    fflush(stdout);
    fr_tp_launch_close(&tl);
    return st ? 1 : 0;
}
