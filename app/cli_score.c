/* fp4rollout score: logits of every prompt position, by one prefill or token
 * by token through the decode path and the cache. */
#include <stdlib.h>
#include <string.h>

#include "base/atomic_file.h"
#include "app/cli.h"
#include "rollout/engine/session.h"
#include "app/tp_launch.h"

const char fr_score_usage[] =
    "usage: fp4rollout score [--model M] (--prompt TEXT | --prompt-text-file F | --prompt-ids IDS\n"
    "                        | --prompt-file F) --out FILE [--decode] [engine options]\n"
    "\n"
    "Writes the float32 logits [tokens][vocab] (little-endian, row-major) at every\n"
    "prompt position to FILE (a prompt as text goes through the model's tokenizer,\n"
    "as generate's): by one prefill (one chunk of the whole prompt\n"
    "unless --chunk says otherwise), or with --decode token by token through the\n"
    "decode path, the KV cache and its quantization. With --tp N under mpirun,\n"
    "every rank computes and world rank 0 writes FILE.\n"
;

static fr_status write_all(const char *path, const float *x, size_t n)
{
    fr_atomic_file out;
    fr_status st = fr_atomic_file_open(&out, path);
    if (st) return st;
    int ok = fwrite(x, sizeof(float), n, out.f) == n;
    st = fr_atomic_file_close(&out, ok);
    return ok || st ? st : fr_fail(FR_EIO, "cannot write %s", path);
}

/* The logits of every position of ids into logits [n][vocab]. */
static fr_status score_logits(fr_session *s, const int *ids, int n, int chunk, int decode, float *logits)
{
    const int V = s->model->cfg.vocab_size;
    int seq;
    if (!decode) return fr_session_prefill(s, ids, n, chunk, &seq, NULL, logits);
    fr_status st = fr_kv_seq_new(s->kv, &seq);
    for (int i = 0; i < n && !st; i++) {
        fr_step_seq step = {.seq = seq, .n = 1, .tokens = ids + i, .all_logits = 1};
        st = fr_session_step(s, &step, 1, logits + (size_t)i * V);
    }
    return st;
}

int fr_cli_score(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_SCORE;
    int rc;
    const int from_command_line = fr_opt_given(v, FR_O_PROMPT_IDS) || fr_opt_given(v, FR_O_PROMPT);
    fr_engine_opts eo;
    fr_cli_engine_opts_get(v, &eo);
    int *ids = NULL, n = 0;
    const int *prompt = NULL;
    const int text = fr_opt_given(v, FR_O_PROMPT) || fr_opt_given(v, FR_O_PROMPT_TEXT_FILE);
    fr_cli_text tx = {0};
    /* only a prompt given as text needs the tokenizer */
    if (text && (rc = fr_cli_text_open(cmd, eo.model, fr_opt_str(v, FR_O_MODEL_TOKENIZER), &tx))) return rc;
    rc = fr_cli_read_prompt(cmd, v, &tx, NULL, &prompt, &n, &ids);
    fr_cli_text_close(&tx);
    if (rc) {
        free(ids);
        return rc;
    }
    if (!fr_opt_given(v, FR_O_CHUNK)) eo.chunk = n > 0 ? n : 1;   /* the whole prompt in one prefill step */
    fr_tp_launch tl;
    if ((rc = fr_cli_launch(cmd, eo.tp, &tl))) {
        free(ids);
        return rc;
    }
    eo.group = tl.group;
    fr_session s;
    float *logits = NULL;
    int opened = 0, status = 1;
    fr_status st = fr_session_open(&eo, (n + 127) / 128 + 1, 1, &s);
    if (!st) {
        opened = 1;
        st = fr_check_prompt(&s.model->cfg, prompt, n, 0);
        if (st && from_command_line) status = 2;   /* a value of the command line the model refuses */
    }
    if (!st) {
        const int V = s.model->cfg.vocab_size;
        logits = malloc(sizeof(float) * (size_t)n * V);
        st = logits ? score_logits(&s, prompt, n, eo.chunk, fr_opt_int(v, FR_O_DECODE), logits)
                    : fr_fail(FR_ENOMEM, "out of memory for %d x %d logits", n, V);
        if (!st && tl.output_rank) st = write_all(fr_opt_str(v, FR_O_OUT), logits, (size_t)n * V);
    }
    if (st) fr_cli_fail(cmd, status);
    free(logits);
    free(ids);
    if (opened) fr_session_close(&s);
    fr_tp_launch_close(&tl);
    return st ? status : 0;
}
