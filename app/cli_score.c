/* fp4rollout score: logits of every prompt position, by one prefill or token
 * by token through the decode path and the cache. */
#include <stdlib.h>
#include <string.h>

#include "base/atomic_file.h"
#include "app/cli.h"
#include "rollout/engine/session.h"
#include "app/tp_launch.h"

static const char usage_text[] =
    "usage: fp4rollout score --model M (--prompt-ids IDS | --prompt-file F) --out FILE\n"
    "                        [--decode] [engine options]\n"
    "\n"
    "Writes the float32 logits [tokens][vocab] (little-endian, row-major) at every\n"
    "prompt position to FILE: by one prefill (one chunk of the whole prompt\n"
    "unless --chunk says otherwise), or with --decode token by token through the\n"
    "decode path, the KV cache and its quantization. With --tp N under mpirun,\n"
    "every rank computes and world rank 0 writes FILE.\n"
    "\n"
    "  --prompt-ids IDS     comma-separated token ids, e.g. 256,105,110\n"
    "  --prompt-file F      a file of token ids (commas or whitespace)\n"
    "  --out FILE           output file (written whole or not at all)\n"
    "  --decode             one decode step per token instead of a prefill\n"
    "engine options:\n";

static fr_status write_all(const char *path, const float *x, size_t n)
{
    fr_atomic_file out;
    fr_status st = fr_atomic_file_open(&out, path);
    if (st) return st;
    int ok = fwrite(x, sizeof(float), n, out.f) == n;
    st = fr_atomic_file_close(&out, ok);
    return ok || st ? st : fr_fail(FR_EIO, "cannot write %s", path);
}

/* The options of this command (app/cli_args.c reads them with getopt_long). */
static const struct option own_opts[] = {
    {"prompt-ids", required_argument, 0, 0}, {"prompt-file", required_argument, 0, 0},
    {"out", required_argument, 0, 0}, {"decode", no_argument, 0, 0}, {0, 0, 0, 0},
};

int fr_cli_score(int argc, char **argv)
{
    const char *cmd = "score", *ids_text = NULL, *ids_file = NULL, *out = NULL;
    int decode = 0;
    fr_engine_opts eo;
    fr_cli_engine_opts_default(&eo);
    eo.chunk = 0;   /* 0: the whole prompt in one prefill step */
    if (fr_cli_wants_help(argc, argv)) {
        printf("%s%s", usage_text, fr_engine_opts_usage);
        return 0;
    }
    if (fr_cli_args(cmd, &argc, &argv, (const struct option *const[]){own_opts, fr_cli_engine_longopts, NULL})) return 2;
    for (int i = 1; i < argc; i++) {
        int r = fr_engine_opts_parse(cmd, argc, argv, &i, &eo);
        if (r < 0) return 2;
        if (r) continue;
        if (strcmp(argv[i], "--prompt-ids") == 0 && i + 1 < argc) ids_text = argv[++i];
        else if (strcmp(argv[i], "--prompt-file") == 0 && i + 1 < argc) ids_file = argv[++i];
        else if (strcmp(argv[i], "--out") == 0 && i + 1 < argc) out = argv[++i];
        else if (strcmp(argv[i], "--decode") == 0) decode = 1;
        else return fr_cli_usage_error(cmd, "unknown or incomplete option '%s'", argv[i]);
    }
    if (!out) return fr_cli_usage_error(cmd, "--out is required");
    if (!!ids_text == !!ids_file) return fr_cli_usage_error(cmd, "give exactly one of --prompt-ids and --prompt-file");
    int *ids = NULL, n = 0;
    fr_status st = ids_text ? fr_parse_ids(ids_text, &ids, &n) : fr_read_ids_file(ids_file, &ids, &n);
    if (st) {
        fprintf(stderr, "fp4rollout score: %s\n", fr_last_error());
        return 2;
    }
    if (eo.chunk == 0) eo.chunk = n > 0 ? n : 1;
    fr_tp_launch tl;
    if ((st = fr_tp_launch_open(eo.tp, &tl))) {
        fprintf(stderr, "fp4rollout score: %s\n", fr_last_error());
        free(ids);
        return 1;
    }
    eo.group = tl.group;
    fr_session s;
    float *logits = NULL;
    int opened = 0;
    st = fr_session_open(&eo, (n + 127) / 128 + 1, 1, &s);
    if (!st) {
        opened = 1;
        st = fr_check_prompt(&s.model->cfg, ids, n, 0);
    }
    if (!st) {
        int V = s.model->cfg.vocab_size, seq;
        logits = malloc(sizeof(float) * (size_t)n * V);
        if (!logits) st = fr_fail(FR_ENOMEM, "out of memory for %d x %d logits", n, V);
        if (!st && !decode) st = fr_session_prefill(&s, ids, n, eo.chunk, &seq, NULL, logits);
        if (!st && decode) {
            st = fr_kv_seq_new(s.kv, &seq);
            for (int i = 0; i < n && !st; i++) {
                fr_step_seq step = {.seq = seq, .n = 1, .tokens = ids + i, .all_logits = 1};
                st = fr_session_step(&s, &step, 1, logits + (size_t)i * V);
            }
        }
        if (!st && tl.output_rank) st = write_all(out, logits, (size_t)n * V);
    }
    if (st) fprintf(stderr, "fp4rollout score: %s\n", fr_last_error());
    free(logits);
    free(ids);
    if (opened) fr_session_close(&s);
    fr_tp_launch_close(&tl);
    return st ? 1 : 0;
}
