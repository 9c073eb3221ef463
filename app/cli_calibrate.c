/* fp4rollout calibrate: the key mean, tau and FP8 scales of a model
 * (paper Appendices B and C), written as a calibration file for --calib. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/monitor/calibrate.h"
#include "app/cli.h"
#include "rollout/engine/session.h"
#ifdef FR_HAVE_CUDA
#include "rollout/model/weights_cuda.h"
#endif

const char fr_calibrate_usage[] =
    "usage: fp4rollout calibrate --model M --texts FILE... --out FILE [--context N]\n"
    "                            [--seed-tokens N] [--continue N] [--tau-steps N]\n"
    "                            [--chunk N] [--kv bf16|f32] [--quiet]\n"
    "\n"
    "Calibrates the FP4 KV cache recipe for a model (paper Appendices B and C) and\n"
    "writes the calibration file that --calib reads: key_mean, tau and fp8_scales.\n"
    "Texts are raw bytes, read as BOS followed by one token per byte.\n"
    "  1. Each text's first --seed-tokens bytes are a seed prompt, which the model\n"
    "     continues greedily for --continue tokens (all texts in one batch).\n"
    "  2. Seeds and continuations are joined and tiled into one sequence that\n"
    "     fills the window (--context tokens).\n"
    "  3. One prefill of it, then --tau-steps greedy decode steps continuing it.\n"
    "     key_mean is the mean post-RoPE key of all of its tokens per layer, KV\n"
    "     head and channel; fp8_scales are amax / 448 of its keys and values per\n"
    "     layer and KV head.\n"
    "  4. The decode queries replay online softmax on the BF16 logits over the\n"
    "     pages an FP4 cache would quantize; tau is the threshold on the E4M3\n"
    "     grid (code k: midway between the E4M3 values of codes k and k+1; the\n"
    "     default 21/1024 is code 10) with the least total squared error of c*p\n"
    "     (c = 8) over all NVFP4 probability blocks.\n"
    "A multi-head latent attention model (DeepSeek-V3) caches one row per token,\n"
    "[latent | RoPE key]: key_mean is then the latent mean (its RoPE part zero),\n"
    "fp8_scales the latent's amax / 448 per layer, and tau keeps its default:\n"
    "latent attention quantizes no probability (paper Appendix G).\n"
    "\n"
    "--backend auto takes the GPU when there is one and gives the same procedure\n"
    "as cpu; --kv is bf16 (the default) or f32: the calibration measures BF16\n"
    "logits.\n";

static void summarize(const char *out, const fr_model_config *mc, const fr_calib_opts *co, int n_texts,
                      const fr_calib *c, const fr_calib_report *rep)
{
    size_t nk = (size_t)mc->num_layers * mc->num_kv_heads * mc->head_dim;
    double sum = 0.0, mx = 0.0;
    for (size_t i = 0; i < nk; i++) {
        sum += fabs(c->key_mean[i]);
        mx = fmax(mx, fabs(c->key_mean[i]));
    }
    float lo[2] = {INFINITY, INFINITY}, hi[2] = {0.0f, 0.0f};
    for (int i = 0; i < mc->num_layers * mc->num_kv_heads; i++)
        for (int j = 0; j < 2; j++) {
            lo[j] = fminf(lo[j], c->fp8_scales[2 * i + j]);
            hi[j] = fmaxf(hi[j], c->fp8_scales[2 * i + j]);
        }
    printf("calibration written to %s\n", out);
    printf("  texts: %d (seed up to %d bytes + %d greedy tokens each); window %d tokens: %d prefilled, "
           "%d decode steps\n", n_texts, co->seed_tokens, co->continue_tokens, rep->n_tokens, rep->prefill_tokens,
           rep->n_tokens - rep->prefill_tokens);
    printf("  key_mean: [%d][%d][%d], mean |mu_k| %.4g, max |mu_k| %.4g\n", mc->num_layers, mc->num_kv_heads,
           mc->head_dim, sum / (double)nk, mx);
    printf("  fp8_scales: K %.4g .. %.4g, V %.4g .. %.4g\n", lo[0], hi[0], lo[1], hi[1]);
    if (fr_model_is_mla(mc)) {
        printf("  latent attention: key_mean holds the latent mean (%d channels, the %d RoPE channels zero); "
               "the FP8 scales cover the latent\n", mc->kv_lora_rank, mc->head_dim - mc->kv_lora_rank);
        printf("  tau: the default %.7g (code %d): latent attention quantizes no probability\n", c->tau,
               FR_TAU_DEFAULT_CODE);
    } else if (co->tau_steps > 0)
        printf("  tau: code %d = %.7g (%g/1024); %ld probability blocks; squared error of c*p %.6g, at the "
               "default code %d: %.6g\n", rep->tau_code, c->tau, c->tau * 1024.0f, rep->tau_blocks, rep->tau_err,
               FR_TAU_DEFAULT_CODE, rep->tau_err_default);
    if (co->tau_steps > 0 && !fr_model_is_mla(mc)) {
        printf("  code   tau (x1024)   blocks in bin   error - error at code %d\n", FR_TAU_DEFAULT_CODE);
        for (int k = 0; k <= 20; k++)
            printf("  %4d %13.4g %15ld %+24.6g%s\n", k, 1024.0 * fr_tau_candidate(k), rep->tau_blocks_by_bin[k],
                   rep->tau_err_by_code[k] - rep->tau_err_default, k == rep->tau_code ? "  <- chosen" : "");
    } else if (!fr_model_is_mla(mc))
        printf("  tau: the default %.7g (code %d), not calibrated (--tau-steps 0)\n", c->tau, FR_TAU_DEFAULT_CODE);
    printf("  time: seeds %.1f s, prefill %.1f s, tau steps %.1f s\n", rep->seconds_seed, rep->seconds_prefill,
           rep->seconds_tau);
}

/* The engine options that apply, checked: one rank, a BF16 or f32 cache,
 * deterministic passes on the CPU. 0, or the exit status after printing why. */
static int calib_opts(fr_cmd cmd, const fr_engine_opts *eo, fr_calib_opts *co, fr_backend *backend)
{
    if (eo->tp > 1) return fr_cli_usage_error(cmd, "--tp %d: calibrate runs on one rank (--tp 1)", eo->tp);
    if (eo->kv != FR_KV_BF16 && eo->kv != FR_KV_F32)
        return fr_cli_usage_error(cmd, "--kv must be bf16 or f32 (the calibration measures BF16 logits)");
    if (eo->deterministic && eo->backend == FR_BACKEND_CUDA)
        return fr_cli_usage_error(cmd, "calibrate --deterministic runs on the CPU backend (docs/determinism.md)");
    /* Calibration's deterministic passes exist on the CPU: auto picks it there. */
    if (fr_backend_pick(eo->deterministic ? FR_BACKEND_CPU : eo->backend, backend)) return fr_cli_fail(cmd, 2);
    co->kv = eo->kv;
    co->chunk = eo->chunk;
    co->deterministic = eo->deterministic;
    return 0;
}

/* The model and texts loaded, the calibration run and written. */
static fr_status calibrate(const fr_engine_opts *eo, fr_backend backend, fr_calib_opts *co, const fr_opt_value *files,
                           const char *out, const fr_tokenizer *tok)
{
    const int n_files = files->n;
    fr_model *m = NULL;
    int **texts = calloc((size_t)n_files, sizeof *texts), *lens = calloc((size_t)n_files, sizeof(int));
    fr_calib c = {0};
    fr_calib_report rep = {0};
    fr_status st = texts && lens ? FR_OK : fr_fail(FR_ENOMEM, "out of memory");
    if (!st) st = fr_model_load(eo->model, &m);
    for (int i = 0; i < n_files && !st; i++) st = fr_text_file_read(&m->cfg, tok, files->list[i], 0, &texts[i], &lens[i]);
#ifdef FR_HAVE_CUDA
    struct fr_weights_gpu *gpu = NULL;
    if (!st && backend == FR_BACKEND_CUDA && !(st = fr_weights_gpu_from_model(m, &gpu))) co->gpu = gpu;
#endif
    if (!st && co->verbose) fprintf(stderr, "calibrate: on the %s backend\n", fr_backend_name(backend));
    if (!st) st = fr_calibrate(m, co, n_files, (const int *const *)texts, lens, &c, &rep);
#ifdef FR_HAVE_CUDA
    fr_weights_gpu_destroy(&gpu);
#endif
    if (!st) st = fr_calib_save(out, fr_model_calib_dims(&m->cfg), &c);
    if (!st) summarize(out, &m->cfg, co, n_files, &c, &rep);
    for (int i = 0; texts && i < n_files; i++) free(texts[i]);
    free(texts);
    free(lens);
    fr_calib_free(&c);
    fr_calib_report_free(&rep);
    fr_model_destroy(&m);
    return st;
}

int fr_cli_calibrate(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_CALIBRATE;
    fr_engine_opts eo;
    fr_calib_opts co;
    fr_backend backend = FR_BACKEND_CPU;
    int rc;
    fr_cli_engine_opts_get(v, &eo);
    fr_calib_opts_default(&co);
    if (fr_opt_given(v, FR_O_CONTEXT)) co.context = fr_opt_int(v, FR_O_CONTEXT);
    co.seed_tokens = fr_opt_int(v, FR_O_SEED_TOKENS);
    co.continue_tokens = fr_opt_int(v, FR_O_CONTINUE);
    co.tau_steps = fr_opt_int(v, FR_O_TAU_STEPS);
    co.verbose = !fr_opt_int(v, FR_O_QUIET);
    if ((rc = calib_opts(cmd, &eo, &co, &backend))) return rc;
    fr_cli_text tx;
    if ((rc = fr_cli_text_open(cmd, eo.model, fr_opt_str(v, FR_O_MODEL_TOKENIZER), &tx))) return rc;
    if (calibrate(&eo, backend, &co, fr_opt_val(v, FR_O_TEXTS), fr_opt_str(v, FR_O_OUT), fr_cli_text_for_files(&tx)))
        rc = fr_cli_fail(cmd, 1);
    fr_cli_text_close(&tx);
    return rc;
}
