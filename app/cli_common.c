/* What several commands share: the bundled demo model, text prompts for
 * byte-level models, files of prompts, the log-prob keys of JSON lines,
 * and the stop signals of long-running commands. */
#include "app/cli.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
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

fr_status fr_cli_ids_file(const char *path, int **ids, int *n)
{
    if (access(path, R_OK) != 0) return fr_fail(FR_EIO, "cannot read %s: %s", path, strerror(errno));
    return fr_read_ids_file(path, ids, n);
}

void fr_cli_prompts_free(fr_cli_prompts *p)
{
    for (int i = 0; i < p->n; i++) free(p->ids[i]);
    free(p->ids);
    free(p->len);
    memset(p, 0, sizeof *p);
}

static fr_status prompts_add(fr_cli_prompts *p, int *ids, int n)
{
    if (p->n == p->cap) {
        int c = p->cap ? p->cap * 2 : 16;
        int **a = realloc(p->ids, sizeof *a * (size_t)c);
        if (a) p->ids = a;
        int *b = a ? realloc(p->len, sizeof *b * (size_t)c) : NULL;
        if (b) p->len = b;
        if (!a || !b) return fr_fail(FR_ENOMEM, "out of memory");
        p->cap = c;
    }
    p->ids[p->n] = ids;
    p->len[p->n++] = n;
    return FR_OK;
}

fr_status fr_cli_prompts_read(const char *path, fr_cli_prompts *p)
{
    FILE *f = fopen(path, "r");
    if (!f) return fr_fail(FR_EIO, "cannot read %s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    fr_status st = FR_OK;
    for (int lineno = 1; !st && getline(&line, &cap, f) >= 0; lineno++) {
        int *ids = NULL, n = 0;
        if ((st = fr_parse_ids(line, &ids, &n))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fr_last_error());
            st = fr_fail(st, "%s line %d: %s", path, lineno, msg);
        } else if (n == 0) {
            free(ids);
        } else if ((st = prompts_add(p, ids, n))) {
            free(ids);
        }
    }
    if (!st && ferror(f)) st = fr_fail(FR_EIO, "cannot read %s: %s", path, strerror(errno));
    free(line);
    fclose(f);
    if (!st && p->n == 0) st = fr_fail(FR_EINVAL, "%s holds no prompt", path);
    return st;
}

static volatile sig_atomic_t stop_flag;

static void on_stop_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

volatile sig_atomic_t *fr_cli_catch_stop(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    return &stop_flag;
}
