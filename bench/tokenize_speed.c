/* tokenize_speed: how fast the tokenizer loads and encodes, on one thread.
 *
 *   build/bench/tokenize_speed TOKENIZER TEXTFILE [--passes N] [--special]
 *
 * TOKENIZER: a tokenizer.json or its folder. Prints the load time (the
 * first load and the best of three) and, for two ways of calling encode,
 * MB/s of UTF-8 input and tokens/s: the whole file as one text, and each
 * line as its own call (where per-call costs show). The first pass runs
 * with cold caches and is reported apart; the others give the median.
 * Rates are per second of the process's CPU time, which other programs on
 * a busy machine do not inflate; the wall-clock rate follows in brackets.
 * bench/tokenize_speed_hf.py measures Hugging Face tokenizers the same
 * way, so the two print comparable lines. Builds without CUDA. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "tokenizer/tokenizer.h"
#include "bench/bench_util.h"

/* One pass: encodes text whole (lines == 0) or line by line; returns the
 * CPU seconds taken (*wall: wall-clock seconds) and adds the ids made to
 * *tokens. */
static double pass(const fr_tokenizer *t, const char *text, size_t len, int lines, int special, size_t *tokens,
                   double *wall)
{
    double t0 = fr_now_s(), c0 = fr_bench_cpu_s();
    size_t from = 0;
    while (from < len) {
        size_t to = len;
        if (lines) {
            const char *nl = memchr(text + from, '\n', len - from);
            to = nl ? (size_t)(nl - text) + 1 : len;
        }
        int *ids;
        size_t n;
        if (fr_tokenizer_encode(t, text + from, to - from, special, &ids, &n) != FR_OK) {
            fprintf(stderr, "tokenize_speed: %s\n", fr_last_error());
            exit(1);
        }
        free(ids);
        *tokens += n;
        from = to;
    }
    *wall = fr_now_s() - t0;
    return fr_bench_cpu_s() - c0;
}

static void report(const fr_tokenizer *t, const char *text, size_t len, int lines, int special, int passes)
{
    size_t tokens = 0;
    double wall, cold = pass(t, text, len, lines, special, &tokens, &wall);
    size_t per_pass = tokens;
    double *s = malloc(2 * (size_t)passes * sizeof *s), *w = s + passes;
    for (int i = 0; i < passes; i++) s[i] = pass(t, text, len, lines, special, &tokens, &w[i]);
    qsort(s, (size_t)passes, sizeof *s, fr_bench_cmp_double);
    qsort(w, (size_t)passes, sizeof *w, fr_bench_cmp_double);
    double med = s[passes / 2], wmed = w[passes / 2];
    printf("encode %-12s %8.2f MB/s %10.0f tokens/s   (wall %.2f MB/s; cold first pass %.2f MB/s; %zu tokens, "
           "%d passes)\n", lines ? "line by line" : "whole file", len / med / 1e6, per_pass / med, len / wmed / 1e6,
           len / cold / 1e6, per_pass, passes);
    free(s);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: tokenize_speed TOKENIZER TEXTFILE [--passes N] [--special]\n");
        return 2;
    }
    int passes = 5, special = 0;
    for (int i = 3; i < argc; i++) {
        if (strcmp(argv[i], "--passes") == 0 && i + 1 < argc) passes = atoi(argv[++i]);
        else if (strcmp(argv[i], "--special") == 0) special = 1;
        else {
            fprintf(stderr, "tokenize_speed: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    if (passes < 1) passes = 1;
    size_t len;
    char *text = fr_bench_read_file(argv[2], &len);
    if (!text) {
        fprintf(stderr, "tokenize_speed: cannot read %s\n", argv[2]);
        return 1;
    }
    fr_tokenizer *t = NULL;
    double first = 0, best = 1e30, best_wall = 1e30;
    for (int i = 0; i < 3; i++) {
        fr_tokenizer_free(&t);
        double t0 = fr_now_s(), c0 = fr_bench_cpu_s();
        if (fr_tokenizer_load(argv[1], &t) != FR_OK) {
            fprintf(stderr, "tokenize_speed: %s\n", fr_last_error());
            return 1;
        }
        double dt = fr_bench_cpu_s() - c0, dw = fr_now_s() - t0;
        if (i == 0) first = dt;
        if (dt < best) best = dt;
        if (dw < best_wall) best_wall = dw;
    }
    printf("tokenizer %s: vocabulary %d; text %s: %zu bytes\n", argv[1], fr_tokenizer_vocab_size(t), argv[2], len);
    printf("load %.3f s (first), %.3f s (best of 3) of CPU time (wall, best: %.3f s)\n", first, best, best_wall);
    report(t, text, len, 0, special, passes);
    report(t, text, len, 1, special, passes);
    fr_tokenizer_free(&t);
    free(text);
    return 0;
}
