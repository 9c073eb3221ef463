/* End-to-end step times of the CUDA engine against the memory roofline.
 *
 * For a model (default synthetic:qwen3-4b, Qwen3-4B's shape with generated
 * weights) and a KV dtype, it measures in one run:
 *   - the device-to-device copy bandwidth (the roofline's denominator);
 *   - prefill throughput: one sequence of --context tokens in --chunk steps;
 *   - decode step time at each --batches size, every sequence at --context
 *     tokens (each prefilled for real, with its own random tokens; with
 *     --fill, filled by fr_session_fill instead: keys and values projected
 *     from the embeddings without attention, so a 64K context takes
 *     seconds, not minutes; decode steps then read caches of the same size
 *     and layout, with other contents), with
 *     sampling on the GPU and the step replayed from a CUDA graph, against
 *     the roofline: (weight bytes + KV bytes read) / copy bandwidth, the KV
 *     bytes being the cache's own page bytes for its dtype; a
 *     Mixture-of-Experts model's weight bytes are its dense part and the
 *     experts its tokens chose in the step.
 * A step's time is the wall time of the call (metadata upload, graph launch,
 * the sampled tokens back on the host); the median of --steps steps after
 * three warm-up steps is reported.
 *
 * Sequences are kept from one batch size to the next (a batch of B decodes
 * the first B), so each is prefilled or filled once; the earlier ones have
 * grown by the steps already decoded, which the context column (the mean
 * over the batch) and the roofline's KV bytes count.
 *
 * With --tp N under `mpirun -np N` the engine is tensor parallel over N GPUs
 * (NCCL); every rank runs the same steps, rank 0 prints, the roofline is one
 * rank's bytes (its weight shard and its KV heads), and tokens/s is given per
 * engine and per GPU.
 *
 * With --vs-deterministic every batch is timed twice, side by side on the
 * same caches: in the default mode and in deterministic mode
 * (docs/determinism.md), with the ratio; the contexts are prefilled or
 * filled in the default mode (their contents do not change a step's cost).
 *
 * usage: decode_step [--model M] [--kv T] [--tp N] [--batches 1,16,64] [--context N]
 *                    [--chunk N] [--steps N] [--fill] [--vs-deterministic] [--markdown]
 * 64K contexts need synthetic:qwen3-4b-128k (Qwen3-4B's window is 40,960).
 * Other shapes: synthetic:qwen3-30b-a3b (Qwen3-MoE), synthetic:deepseek-v2-lite
 * (DeepSeek-V2-Lite: latent attention, routed and shared experts; a 32K window).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "kvcache/page_layout.h"
#include "rollout/model/runner_cuda.h"
#include "rollout/engine/session.h"
#include "app/cli.h"
#include "app/tp_launch.h"
#include "bench/copy_bandwidth.h"
#include "base/clock.h"
#include "bench/bench_util.h"

/* Bytes read plus written per second by cudaMemcpy device to device on 2 GiB. */
/* The weight bytes a decode step reads. A dense model reads all of them; a
 * Mixture-of-Experts model reads its dense part and, per layer, the experts
 * its tokens chose (counted on the last step run, printed with the spread of
 * the last layer's load over the experts). */
static size_t step_weight_bytes(const fr_session *s, size_t all, int batch)
{
    const fr_model_config *c = &s->gpu_weights->cfg;
    if (c->num_experts == 0) return all;
    int *active = calloc((size_t)c->num_layers, sizeof(int)), *counts = calloc((size_t)c->num_experts, sizeof(int));
    size_t per_expert = 3 * (size_t)c->moe_intermediate_size * (size_t)c->hidden_size * 2, bytes = all;
    if (active && counts && !fr_runner_cuda_moe_usage(fr_runner_cuda_of(s->runner), active, counts)) {
        long used = 0;
        int most = 0, idle = 0;
        for (int l = 0; l < c->num_layers; l++)
            if (fr_model_layer_is_moe(c, l)) {
                bytes -= per_expert * (size_t)c->num_experts;
                bytes += per_expert * (size_t)active[l];
                used += active[l];
            }
        for (int e = 0; e < c->num_experts; e++) {
            most = counts[e] > most ? counts[e] : most;
            idle += counts[e] == 0;
        }
        fprintf(stderr, "batch %d: %.1f of %d experts active per layer; last layer: busiest expert %d of %d "
                "token-expert pairs (even share %.1f), %d experts idle\n", batch, (double)used / c->num_layers,
                c->num_experts, most, batch * c->experts_per_tok, (double)batch * c->experts_per_tok / c->num_experts,
                idle);
    }
    free(active);
    free(counts);
    return bytes;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: decode_step [--model M] [--kv T] [--tp N] [--batches 1,16,64] [--context N] [--chunk N]\n"
               "                   [--steps N] [--fill] [--vs-deterministic] [--markdown]\n"
               "  --fill   fill the contexts without attention (fr_session_fill) instead of prefilling them;\n"
               "           the prefill figure is then the fill's. 64K contexts: --model synthetic:qwen3-4b-128k\n"
               "  --vs-deterministic  time each batch in the default mode and in deterministic mode\n"
               "  models: synthetic:qwen3-4b (default), qwen3-14b, qwen3-30b-a3b, deepseek-v2-lite, or a folder\n"
               "Decode step time and prefill throughput of the CUDA engine against the memory roofline.\n");
}

/* A new sequence holding the n tokens' keys and values, written chunk by
 * chunk without attention (fr_session_fill). */
static fr_status fill_context(fr_session *s, const int *ids, int n, int chunk, int *seq)
{
    fr_status st = fr_kv_seq_new(s->kv, seq);
    for (int at = 0; at < n && !st; at += chunk) {
        fr_step_seq one = {.seq = *seq, .n = n - at < chunk ? n - at : chunk, .tokens = ids + at};
        st = fr_session_fill(s, &one, 1);
    }
    if (st) fr_kv_seq_free(s->kv, *seq);
    return st;
}

/* The median wall time of n_steps decode steps of the first B sequences
 * (after three warm-up steps), each sampling at temperature 1 on the GPU. */
static int time_steps(fr_session *s, int B, const int *seqs, int *tok, int n_steps, double *median)
{
    fr_step_seq *steps = malloc(sizeof *steps * (size_t)B);
    fr_decode_row *rows = malloc(sizeof *rows * (size_t)B);
    double *times = malloc(sizeof(double) * (size_t)n_steps);
    int rc = steps && rows && times ? 0 : 1;
    for (int it = 0; !rc && it < n_steps + 3; it++) {
        for (int b = 0; b < B; b++) {
            steps[b] = (fr_step_seq){.seq = seqs[b], .n = 1, .tokens = &tok[b]};
            rows[b] = (fr_decode_row){.params = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 7},
                                      .sequence = (uint64_t)b, .step = (uint64_t)it};
        }
        double t = fr_now_s();
        if (fr_session_decode(s, steps, rows, B, tok, NULL)) {
            fprintf(stderr, "decode_step: %s\n", fr_last_error());
            rc = 1;
        }
        if (it >= 3) times[it - 3] = fr_now_s() - t;
    }
    if (!rc) {
        qsort(times, (size_t)n_steps, sizeof(double), fr_bench_cmp_double);
        *median = times[n_steps / 2];
    }
    free(steps);
    free(rows);
    free(times);
    return rc;
}

/* A real prefill (attention included) of n tokens timed in the default mode
 * and in deterministic mode (the second of two runs each); back to the
 * default mode after. */
static int prefill_both_modes(fr_session *s, const int *ids, int n, int chunk, float *last, double secs[2])
{
    for (int mode = 0; mode < 2; mode++)
        for (int rep = 0; rep < 2; rep++) {   /* the first run warms the plans */
            double a = fr_now_s();
            int seq;
            if (fr_runner_set_deterministic(s->runner, mode) ||
                fr_session_prefill(s, ids, n, chunk, &seq, last, NULL)) {
                fprintf(stderr, "decode_step: %s\n", fr_last_error());
                return 1;
            }
            secs[mode] = fr_now_s() - a;
            fr_kv_seq_free(s->kv, seq);
        }
    if (fr_runner_set_deterministic(s->runner, 0)) {
        fprintf(stderr, "decode_step: %s\n", fr_last_error());
        return 1;
    }
    return 0;
}

/* What the table's header and first lines say. */
typedef struct {
    const char *model;
    fr_kv_dtype kv;
    fr_fp4_compute compute;
    int tp;
    double bw, weight_bytes;
    int fill, context, chunk;
    double prefill_s;
    int vs_det, pc;
    double mode_s[2];
} header;

static void print_header(const header *h, int markdown)
{
    const int fp4 = fr_kv_dtype_is_fp4(h->kv);   /* its compute mode is named */
    if (markdown) {
        printf("| model | kv | tp | copy bandwidth | weights per GPU | %s %d tokens (chunk %d) |\n"
               "|---|---|---|---|---|---|\n", h->fill ? "fill (no attention)" : "prefill", h->context, h->chunk);
        printf("| %s | %s%s%s%s | %d | %.2f TB/s | %.2f GB | %.3f s, %.0f tokens/s |\n\n", h->model,
               fr_kv_dtype_name(h->kv), fp4 ? " (" : "", fp4 ? fr_fp4_compute_name(fr_fp4_compute_for(h->compute, FR_BACKEND_CUDA)) : "", fp4 ? ")" : "", h->tp, h->bw / 1e12, h->weight_bytes / 1e9, h->prefill_s, h->context / h->prefill_s);
        if (h->vs_det)
            printf("prefill of %d tokens (chunk %d): %.3f s default, %.3f s deterministic (%.2fx)\n\n", h->pc, h->chunk,
                   h->mode_s[0], h->mode_s[1], h->mode_s[1] / h->mode_s[0]);
        if (h->vs_det)
            printf("| batch | context | step ms, default | step ms, deterministic | deterministic / default time | "
                   "tokens/s, default | tokens/s, deterministic | roofline ms | of roofline, default | "
                   "of roofline, deterministic |\n|---|---|---|---|---|---|---|---|---|---|\n");
        else
            printf("| batch | context | step ms (median) | tokens/s | tokens/s per GPU | bytes/step per GPU | "
                   "roofline ms | of roofline |\n|---|---|---|---|---|---|---|---|\n");
    } else if (h->vs_det) {
        printf("copy bandwidth %.2f TB/s, weights %.2f GB; prefill of %d tokens (chunk %d): %.3f s default, %.3f s "
               "deterministic\n", h->bw / 1e12, h->weight_bytes / 1e9, h->pc, h->chunk, h->mode_s[0],
               h->mode_s[1]);
        printf("%6s %8s %12s %12s %8s %12s\n", "batch", "context", "default ms", "determ. ms", "ratio", "roofline ms");
    } else {
        printf("copy bandwidth %.2f TB/s, weights %.2f GB, prefill %d tokens in %.3f s (%.0f tokens/s)\n", h->bw / 1e12,
               h->weight_bytes / 1e9, h->context, h->prefill_s, h->context / h->prefill_s);
        printf("%6s %8s %12s %10s %12s %12s %10s\n", "batch", "context", "step ms", "tokens/s", "GB/step",
               "roofline ms", "ratio");
    }
}

/* One batch's row of the table: its step times (median seconds) and
 * rooflines in the default mode and, with --vs-deterministic, in
 * deterministic mode. */
typedef struct {
    int B;
    double ctx_mid, bytes;
    double med[2], roof[2];
} row;

/* Steps the batch's B sequences n_steps times in each mode (the default;
 * then deterministic with vs_det, and back to the default after, as the
 * next fills run in it). */
static int time_modes(fr_session *s, const int *seqs, int *tok, int *len, int n_steps, int vs_det,
                      double weight_bytes, double kv_token_bytes, double bw, row *w)
{
    const int B = w->B;
    for (int mode = 0; mode < (vs_det ? 2 : 1); mode++) {
        if (vs_det && fr_runner_set_deterministic(s->runner, mode)) {
            fprintf(stderr, "decode_step: %s\n", fr_last_error());
            return 1;
        }
        double tokens_before = 0.0;   /* cached tokens of the batch before its first step */
        for (int b = 0; b < B; b++) tokens_before += len[b];
        if (time_steps(s, B, seqs, tok, n_steps, &w->med[mode])) return 1;
        for (int b = 0; b < B; b++) len[b] += n_steps + 3;
        w->ctx_mid = tokens_before / B + 3 + n_steps / 2.0;   /* at the median step */
        w->bytes = (double)step_weight_bytes(s, (size_t)weight_bytes, B) + B * w->ctx_mid * kv_token_bytes;
        w->roof[mode] = w->bytes / bw;
    }
    if (vs_det && fr_runner_set_deterministic(s->runner, 0)) {
        fprintf(stderr, "decode_step: %s\n", fr_last_error());
        return 1;
    }
    return 0;
}

static void print_row(const row *w, int tp, int vs_det, int markdown)
{
    const int B = w->B;
    const double med = w->med[0], roof = vs_det ? w->roof[1] : w->roof[0], ctx_mid = w->ctx_mid;
    if (vs_det && markdown)
        printf("| %d | %.0f | %.3f | %.3f | %.3f | %.0f | %.0f | %.3f | %.1f%% | %.1f%% |\n", B, ctx_mid,
               med * 1e3, w->med[1] * 1e3, w->med[1] / med, B / med, B / w->med[1], roof * 1e3,
               100.0 * w->roof[0] / med, 100.0 * w->roof[1] / w->med[1]);
    else if (vs_det)
        printf("%6d %8.0f %12.3f %12.3f %8.3f %12.3f\n", B, ctx_mid, med * 1e3, w->med[1] * 1e3,
               w->med[1] / med, roof * 1e3);
    else if (markdown)
        printf("| %d | %.0f | %.3f | %.0f | %.0f | %.2f GB | %.3f | %.1f%% |\n", B, ctx_mid, med * 1e3, B / med,
               B / med / tp, w->bytes / 1e9, roof * 1e3, 100.0 * roof / med);
    else
        printf("%6d %8.0f %12.3f %10.0f %12.2f %12.3f %9.1f%%\n", B, ctx_mid, med * 1e3, B / med, w->bytes / 1e9,
               roof * 1e3, 100.0 * roof / med);
    fflush(stdout);
}

/* The copy bandwidth, measured after the session took its memory: with the
 * cache sized to nearly all of it (bench/decode_64k.sh's peaks) two 2 GiB
 * buffers may not fit, and smaller copies, down to 256 MiB (still four
 * times the L2), measure the same bandwidth. 0 when none fits. */
static double copy_bandwidth(void)
{
    double bw = 0.0;
    for (size_t bytes = (size_t)2 << 30; bw == 0.0 && bytes >= ((size_t)256 << 20); bytes /= 2)
        bw = fr_bench_copy_bandwidth(bytes, 0);
    return bw;
}

int main(int argc, char **argv)
{
    fr_engine_opts eo;
    fr_engine_opts_default(&eo);
    eo.model = "synthetic:qwen3-4b";
    eo.backend = FR_BACKEND_CUDA;
    eo.chunk = 2048;
    const char *batches_text = "1,16,64";
    int context = 4096, n_steps = 20, markdown = 0, fill = 0, vs_det = 0;
    for (int i = 1; i < argc; i++) {
        int used = fr_engine_opts_parse("decode_step", argc, argv, &i, &eo);
        if (used < 0) return 2;
        if (used) continue;
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) { usage(stdout); return 0; }
        else if (strcmp(argv[i], "--batches") == 0 && i + 1 < argc) batches_text = argv[++i];
        else if (strcmp(argv[i], "--context") == 0 && i + 1 < argc) context = atoi(argv[++i]);
        else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) n_steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--markdown") == 0) markdown = 1;
        else if (strcmp(argv[i], "--fill") == 0) fill = 1;
        else if (strcmp(argv[i], "--vs-deterministic") == 0) vs_det = 1;
        else { usage(stderr); return 2; }
    }
    int *batches = NULL, n_batches = 0, max_batch = 0;
    if (fr_parse_ids(batches_text, &batches, &n_batches) || n_batches < 1 || context < 2 || n_steps < 1) {
        usage(stderr);
        return 2;
    }
    for (int i = 0; i < n_batches; i++) max_batch = batches[i] > max_batch ? batches[i] : max_batch;
    /* room for every step of every batch size (sequences are kept across them) */
    const int modes = vs_det ? 2 : 1;
    const int pages = (context + modes * n_batches * (n_steps + 3) + 8 + 127) / 128 + 1;
    if (vs_det && (eo.deterministic || eo.tp > 1)) {
        fprintf(stderr, "decode_step: --vs-deterministic times both modes itself, with --tp 1\n");
        return 2;
    }
    fr_tp_launch launch;
    if (fr_tp_launch_open(eo.tp, &launch)) {
        fprintf(stderr, "decode_step: %s\n", fr_last_error());
        return 1;
    }
    eo.group = launch.group;
    if (!launch.output_rank) {   /* only rank 0 prints */
        if (!freopen("/dev/null", "w", stdout)) return 1;
    }
    fr_session s;
    double t0 = fr_now_s();
    if (fr_session_open(&eo, pages * (max_batch + 1), max_batch + 1, &s)) {
        fprintf(stderr, "decode_step: %s\n", fr_last_error());
        fr_tp_launch_close(&launch);
        return 1;
    }
    const fr_model_config *c = &s.model->cfg;
    fprintf(stderr, "model %s loaded on the GPU in %.1f s\n", eo.model, fr_now_s() - t0);
    const double bw = copy_bandwidth();
    size_t weight_bytes = s.gpu_weights->bytes;
    const int tp = eo.tp, kvh = fr_kv_cache_config_of(s.kv)->n_kv_heads;   /* this rank's KV heads */
    /* KV bytes a decode reads per cached token: the cache's own page bytes
     * (codes and block scales of K and V; docs/formats.md), all layers and
     * this rank's KV heads. The BF16 sink and recent tokens are a few
     * hundred per sequence and are counted as page tokens too. */
    const double head_page = (double)fr_kv_layout(s.kv)->head_page_bytes;
    double kv_token_bytes = (double)c->num_layers * kvh * head_page / 128.0;

    /* Prefill throughput: one sequence of `context` tokens. */
    int *ids = malloc(sizeof(int) * (size_t)context);
    unsigned rng = 12345;
    for (int i = 0; i < context; i++) ids[i] = (int)((rng = rng * 1103515245u + 12345u) >> 8) % c->vocab_size;
    int seq;
    float *last = malloc(sizeof(float) * (size_t)c->vocab_size);
    double prefill_s = 0.0;
    for (int rep = 0; rep < 2; rep++) {   /* the first run warms the plans */
        double a = fr_now_s();
        if (fill ? fill_context(&s, ids, context, eo.chunk, &seq)
                 : fr_session_prefill(&s, ids, context, eo.chunk, &seq, last, NULL)) {
            fprintf(stderr, "decode_step: %s\n", fr_last_error());
            return 1;
        }
        prefill_s = fr_now_s() - a;
        fr_kv_seq_free(s.kv, seq);
    }
    /* With --vs-deterministic: a real prefill of up to 4,096 tokens in each mode. */
    double prefill_mode_s[2] = {0, 0};
    const int pc = context < 4096 ? context : 4096;
    if (vs_det && prefill_both_modes(&s, ids, pc, eo.chunk, last, prefill_mode_s)) return 1;
    {
        const header h = {eo.model, eo.kv, eo.compute, tp, bw, (double)weight_bytes, fill, context, eo.chunk, prefill_s,
                          vs_det, pc, {prefill_mode_s[0], prefill_mode_s[1]}};
        print_header(&h, markdown);
    }

    int *seqs = malloc(sizeof(int) * (size_t)max_batch), *tok = malloc(sizeof(int) * (size_t)max_batch);
    int *len = malloc(sizeof(int) * (size_t)max_batch), n_filled = 0;
    for (int bi = 0; bi < n_batches; bi++) {
        int B = batches[bi];
        double a = fr_now_s();
        for (int b = n_filled; b < B; b++, n_filled++) {   /* each sequence its own tokens */
            for (int i = 0; i < context; i++) ids[i] = (int)((rng = rng * 1103515245u + 12345u) >> 8) % c->vocab_size;
            if (fill ? fill_context(&s, ids, context, eo.chunk, &seqs[b])
                     : fr_session_prefill(&s, ids, context, eo.chunk, &seqs[b], last, NULL)) {
                fprintf(stderr, "decode_step: %s\n", fr_last_error());
                return 1;
            }
            tok[b] = 0;
            len[b] = context;
        }
        fprintf(stderr, "batch %d: %d sequences of %d tokens %s in %.1f s\n", B, B, context,
                fill ? "filled" : "prefilled", fr_now_s() - a);
        row w = {.B = B};
        if (time_modes(&s, seqs, tok, len, n_steps, vs_det, (double)weight_bytes, kv_token_bytes, bw, &w)) return 1;
        print_row(&w, tp, vs_det, markdown);
    }
    for (int b = 0; b < n_filled; b++) fr_kv_seq_free(s.kv, seqs[b]);
    free(seqs); free(tok); free(len); free(ids); free(last); free(batches);
    fr_session_close(&s);
    fr_tp_launch_close(&launch);
    return 0;
}
