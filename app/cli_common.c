/* What several commands share: the bundled demo model, whether a model is
 * byte-level, files of prompts, the log-prob keys of JSON lines,
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

#include <cjson/cJSON.h>

#include "base/text_lines.h"

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

void fr_cli_json_routes(fr_buf *b, const uint8_t *ids, int n_tokens, int layers, int k, int width)
{
    if (!ids) return;
    fr_buf_printf(b, ",\"routed_experts\":[");
    for (int i = 0; i < n_tokens; i++) {
        fr_buf_printf(b, "%s[", i ? "," : "");
        for (int m = 0; m < layers; m++) {
            fr_buf_printf(b, "%s[", m ? "," : "");
            for (int j = 0; j < k; j++) {
                const uint8_t *p = ids + (((size_t)i * (size_t)layers + (size_t)m) * (size_t)k + (size_t)j) * (size_t)width;
                fr_buf_printf(b, "%s%d", j ? "," : "", width == 1 ? p[0] : p[0] | p[1] << 8);
            }
            fr_buf_printf(b, "]");
        }
        fr_buf_printf(b, "]");
    }
    fr_buf_printf(b, "]");
}

fr_status fr_cli_ids_file(const char *path, int **ids, int *n)
{
    if (access(path, R_OK) != 0) return fr_fail(FR_EIO, "cannot read %s: %s", path, strerror(errno));
    return fr_read_ids_file(path, ids, n);
}

void fr_cli_prompts_free(fr_cli_prompts *p)
{
    for (int i = 0; i < p->n; i++) {
        free(p->ids[i]);
        free(p->text[i]);
    }
    free(p->ids);
    free(p->len);
    free(p->text);
    memset(p, 0, sizeof *p);
}

/* Adds a prompt: ids (n of them) or text (malloc'ed, NUL-terminated). */
static fr_status prompts_add(fr_cli_prompts *p, int *ids, int n, char *text)
{
    if (p->n == p->cap) {
        int c = p->cap ? p->cap * 2 : 16;
        int **a = realloc(p->ids, sizeof *a * (size_t)c);
        if (a) p->ids = a;
        int *b = a ? realloc(p->len, sizeof *b * (size_t)c) : NULL;
        if (b) p->len = b;
        char **t = b ? realloc(p->text, sizeof *t * (size_t)c) : NULL;
        if (t) p->text = t;
        if (!a || !b || !t) return fr_fail(FR_ENOMEM, "out of memory");
        p->cap = c;
    }
    p->ids[p->n] = ids;
    p->text[p->n] = text;
    p->len[p->n++] = n;
    return FR_OK;
}

/* A line that is a JSON string: its text (malloc'ed), or FR_EINVAL. */
static fr_status json_text_line(const char *line, char **text)
{
    cJSON *j = cJSON_Parse(line);
    fr_status st = FR_OK;
    if (!cJSON_IsString(j)) st = fr_fail(FR_EINVAL, "a line starting with '\"' must be one JSON string (the prompt's text)");
    else if (!j->valuestring[0]) st = fr_fail(FR_EINVAL, "the prompt's text is empty");
    else if (!(*text = strdup(j->valuestring))) st = fr_fail(FR_ENOMEM, "out of memory");
    cJSON_Delete(j);
    return st;
}

/* One line of a prompts file into p (a blank one adds nothing). */
static fr_status prompts_line(const char *line, fr_cli_prompts *p)
{
    const char *s = line + strspn(line, " \t");
    int *ids = NULL, n = 0;
    char *text = NULL;
    fr_status st = *s == '"' ? json_text_line(s, &text) : fr_parse_ids(line, &ids, &n);
    if (!st && (text || n > 0)) st = prompts_add(p, ids, n, text);
    else if (!st) free(ids);
    if (st) {
        free(ids);
        free(text);
    }
    return st;
}

static fr_status prompts_line_of(void *p, const char *line) { return prompts_line(line, p); }

fr_status fr_cli_prompts_read(const char *path, fr_cli_prompts *p)
{
    fr_status st = fr_read_lines(path, prompts_line_of, p);
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
