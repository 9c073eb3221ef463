/* stop_strings_speed: what a sample's text costs the scheduler's host side
 * per token (rollout/engine/stop_strings.h): the incremental detokenizer
 * alone (a request asking for text), with 2 stop strings, and with 32 stop
 * strings of 16 bytes (the most a request may give) that never match, so
 * every token is pushed through every automaton.
 *
 *   build/bench/stop_strings_speed [TOKENIZER [TEXTFILE]]
 *
 * TOKENIZER: a tokenizer.json or its folder (default: the byte-level one);
 * TEXTFILE: the text whose tokens are pushed (default: a built-in paragraph
 * of English, code and CJK repeated), in samples of 1,024 tokens, each with
 * a fresh state. Prints nanoseconds of CPU time per token: on CUDA the
 * tokens reach the host every step anyway, so this is the whole cost of a
 * sample with stop strings, paid only by the samples that have them. Builds
 * without CUDA. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rollout/engine/stop_strings.h"
#include "tokenizer/tokenizer.h"
#include "bench/bench_util.h"

static const char sample_text[] =
    "The answer is 42, as the scheduler's postprocessing shows.\n\ndef step(self, batch):\n"
    "    return [t for t in batch if t is not None]  # \xe8\xbf\x99\xe6\x98\xaf\xe4\xb8\xad\xe6\x96\x87 "
    "\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88 \xf0\x9f\x99\x82 caf\xc3\xa9\n";

/* ns of CPU time per token pushed through fresh states of `per` tokens. */
static double per_token_ns(const fr_tokenizer *tok, const fr_stop_strings *stops, const int *ids, size_t n,
                           size_t per)
{
    double best = 1e30;
    for (int pass = 0; pass < 3; pass++) {
        const double t0 = fr_bench_cpu_s();
        for (size_t at = 0; at + per <= n; at += per) {
            fr_sample_text *st;
            if (fr_sample_text_new(tok, stops, 1, &st)) return -1;
            for (size_t i = 0; i < per; i++) {
                int m;
                if (fr_sample_text_push(st, ids[at + i], 1, &m) || m >= 0) {
                    fr_sample_text_free(&st);
                    return -1;
                }
            }
            fr_sample_text_free(&st);
        }
        const double dt = (fr_bench_cpu_s() - t0) / (double)(n / per * per);
        if (dt < best) best = dt;
    }
    return best * 1e9;
}

int main(int argc, char **argv)
{
    fr_tokenizer *tok = NULL;
    if ((argc > 1 ? fr_tokenizer_load(argv[1], &tok) : fr_tokenizer_bytes(272, 256, 257, &tok)) != FR_OK) {
        fprintf(stderr, "stop_strings_speed: %s\n", fr_last_error());
        return 1;
    }
    size_t len = 0;
    char *text = argc > 2 ? fr_bench_read_file(argv[2], &len) : NULL;
    if (argc > 2 && !text) {
        fprintf(stderr, "stop_strings_speed: cannot read %s\n", argv[2]);
        fr_tokenizer_free(&tok);
        return 1;
    }
    if (!text) {   /* the paragraph, repeated to 256 KB */
        const size_t one = strlen(sample_text), times = (256u << 10) / one;
        text = malloc(one * times + 1);
        for (size_t i = 0; text && i < times; i++) memcpy(text + i * one, sample_text, one);
        len = text ? one * times : 0;
    }
    int *ids = NULL;
    size_t n = 0;
    if (!text || fr_tokenizer_encode(tok, text, len, 0, &ids, &n) != FR_OK || n < 1024) {
        fprintf(stderr, "stop_strings_speed: the text gives %zu tokens (1,024 needed): %s\n", n, fr_last_error());
        free(text);
        fr_tokenizer_free(&tok);
        return 1;
    }
    const char *two[] = {"</answer>", "\n\n\n\n"};
    static char bufs[32][17];
    const char *many[32];
    for (int i = 0; i < 32; i++) {   /* 16 bytes each, no match in the text: "zq00zq00...", "zq01..." */
        snprintf(bufs[i], sizeof bufs[i], "zq%02dzq%02dzq%02dzq%02d", i, i, i, i);
        many[i] = bufs[i];
    }
    const fr_stop_strings none = {0}, s2 = {.s = two, .n = 2}, s32 = {.s = many, .n = 32};
    printf("stop_strings_speed: %s, %zu tokens in samples of 1024\n", argc > 1 ? argv[1] : "byte-level", n);
    printf("  text only          %7.1f ns/token\n", per_token_ns(tok, &none, ids, n, 1024));
    printf("  2 stop strings     %7.1f ns/token\n", per_token_ns(tok, &s2, ids, n, 1024));
    printf("  32 stop strings    %7.1f ns/token\n", per_token_ns(tok, &s32, ids, n, 1024));
    free(ids);
    free(text);
    fr_tokenizer_free(&tok);
    return 0;
}
