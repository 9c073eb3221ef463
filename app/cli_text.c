/* Text in and out of the engine commands (docs/tokenizer.md, "Where text
 * enters"): which tokenizer a model has, prompts as text, text in JSON
 * lines. */
#include "app/cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "rollout/model/model.h"

#define FR_CLI_MAX_TEXT (1 << 24)   /* bytes of a prompt given as text */

/* A tokenizer whose ids the model cannot embed, or which covers less than
 * half of its vocabulary, is another model's. */
static fr_status fits(const fr_tokenizer *tok, const char *name, const fr_model_config *mc)
{
    const int n = fr_tokenizer_vocab_size(tok);
    if (n > mc->vocab_size)
        return fr_fail(FR_EINVAL, "the tokenizer %s knows %d ids, more than the model's vocabulary of %d: it is "
                                  "another model's tokenizer", name, n, mc->vocab_size);
    if (n < mc->vocab_size / 2)
        return fr_fail(FR_EINVAL, "the tokenizer %s knows %d ids, less than half of the model's vocabulary of %d: "
                                  "it is another model's tokenizer", name, n, mc->vocab_size);
    return FR_OK;
}

static int has_tokenizer_json(const char *dir)
{
    char path[4200];
    struct stat sb;
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

int fr_cli_text_open(fr_cmd cmd, const char *model, const char *tokenizer_path, fr_cli_text *t)
{
    memset(t, 0, sizeof *t);
    fr_model_config mc;
    if (fr_model_spec_config(model, &mc)) return fr_cli_fail(cmd, 1);
    if (tokenizer_path) {   /* asked for: its failures are the command's */
        snprintf(t->name, sizeof t->name, "%s", tokenizer_path);
        if (fr_tokenizer_load(tokenizer_path, &t->tok)) return fr_cli_fail(cmd, 1);
        if (fits(t->tok, tokenizer_path, &mc)) {
            fr_cli_text_close(t);
            return fr_cli_fail(cmd, 2);
        }
        return 0;
    }
    if (strncmp(model, FR_SYNTHETIC_PREFIX, strlen(FR_SYNTHETIC_PREFIX)) != 0 && has_tokenizer_json(model)) {
        /* the checkpoint's own: without it ids still work, so a failure only refuses text */
        snprintf(t->name, sizeof t->name, "%s", model);
        if (fr_tokenizer_load(model, &t->tok) || fits(t->tok, model, &mc)) {
            snprintf(t->why, sizeof t->why, "its tokenizer.json is not usable here: %s", fr_last_error());
            fr_tokenizer_free(&t->tok);
            fr_warn("%s: %s; prompts as text are refused", fr_cmd_name(cmd), t->why);
        }
        return 0;
    }
    if (fr_cli_byte_model(&mc)) {
        snprintf(t->name, sizeof t->name, "byte-level");
        t->bytes = 1;
        if (fr_tokenizer_bytes(mc.vocab_size, mc.bos_id, mc.n_eos > 0 ? mc.eos_ids[0] : -1, &t->tok))
            return fr_cli_fail(cmd, 1);
        return 0;
    }
    if (strncmp(model, FR_SYNTHETIC_PREFIX, strlen(FR_SYNTHETIC_PREFIX)) == 0)
        snprintf(t->why, sizeof t->why, "%s is synthetic, ships no tokenizer.json and is not byte-level", model);
    else
        snprintf(t->why, sizeof t->why, "its folder holds no tokenizer.json and it is not byte-level");
    return 0;
}

void fr_cli_text_close(fr_cli_text *t)
{
    if (t) fr_tokenizer_free(&t->tok);
}

fr_status fr_cli_text_none(const fr_cli_text *t, const char *what)
{
    return fr_fail(FR_EINVAL, "%s needs the model's tokenizer, and this model has none (%s): give --tokenizer PATH "
                              "(a tokenizer.json or the folder holding it), or token ids",
                   what, t->why[0] ? t->why : "none was found");
}

fr_status fr_cli_text_encode(const fr_cli_text *t, const char *what, const char *text, size_t len, int **ids, int *n)
{
    *ids = NULL;
    *n = 0;
    if (!t->tok) return fr_cli_text_none(t, what);
    if (len == 0) return fr_fail(FR_EINVAL, "%s: the text is empty", what);
    if (len > FR_CLI_MAX_TEXT) return fr_fail(FR_EINVAL, "%s: text longer than 16 MiB", what);
    size_t got = 0;
    fr_status st = fr_tokenizer_encode(t->tok, text, len, 1, ids, &got);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        return fr_fail(st, "%s: %s", what, msg);
    }
    if (got == 0) return fr_fail(FR_EINVAL, "%s: the text encodes to no token", what);
    *n = (int)got;
    return FR_OK;
}

fr_status fr_cli_read_text(const char *path, char **text, size_t *len)
{
    *text = NULL;
    *len = 0;
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!f) return fr_fail(FR_EIO, "cannot read %s: %s", path, strerror(errno));
    fr_buf b = {0};
    char chunk[1 << 16];
    size_t got;
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0 && b.len <= FR_CLI_MAX_TEXT) fr_buf_put(&b, chunk, got);
    const int bad = ferror(f);
    if (f != stdin) fclose(f);
    if (bad || b.failed) {
        fr_buf_free(&b);
        return bad ? fr_fail(FR_EIO, "cannot read %s", path) : fr_fail(FR_ENOMEM, "out of memory reading %s", path);
    }
    *text = b.data ? b.data : calloc(1, 1);
    *len = b.len;
    return *text ? FR_OK : fr_fail(FR_ENOMEM, "out of memory reading %s", path);
}

void fr_cli_json_string(fr_buf *b, const char *key, const char *s, size_t n)
{
    fr_buf_printf(b, ",\"%s\":\"", key);
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fr_buf_printf(b, "\\%c", c);
        else if (c == '\n') fr_buf_put(b, "\\n", 2);
        else if (c == '\t') fr_buf_put(b, "\\t", 2);
        else if (c < 0x20 || c == 0x7F) fr_buf_printf(b, "\\u%04x", c);
        else fr_buf_put(b, s + i, 1);   /* UTF-8 as it is: the tokenizer's text always is */
    }
    fr_buf_put(b, "\"", 1);
}

fr_status fr_cli_stops_of(const fr_cli_values *v, fr_opt_id id, int include, fr_stop_strings *out)
{
    const fr_opt_value *s = fr_opt_val(v, id);
    *out = (fr_stop_strings){.s = s->given ? s->list : NULL, .n = s->given ? s->n : 0, .include = include};
    return fr_stop_strings_check(out, "--stop");
}

/* What a prompt's text says, from --prompt or --prompt-text-file. 0, or the
 * exit status after printing why. */
static int prompt_text(fr_cmd cmd, const fr_cli_values *v, const fr_cli_text *t, int **ids, int *n)
{
    const int from_file = fr_opt_given(v, FR_O_PROMPT_TEXT_FILE);
    const char *what = from_file ? "--prompt-text-file" : "--prompt";
    if (!t->tok) {
        fr_cli_text_none(t, what);
        return fr_cli_fail(cmd, 2);
    }
    char *text = NULL;
    size_t len = 0;
    fr_status st = FR_OK;
    if (from_file) st = fr_cli_read_text(fr_opt_str(v, FR_O_PROMPT_TEXT_FILE), &text, &len);
    if (st) return fr_cli_fail(cmd, 1);
    st = fr_cli_text_encode(t, what, from_file ? text : fr_opt_str(v, FR_O_PROMPT),
                            from_file ? len : strlen(fr_opt_str(v, FR_O_PROMPT)), ids, n);
    free(text);
    return st ? fr_cli_fail(cmd, from_file ? 1 : 2) : 0;
}

int fr_cli_read_prompt(fr_cmd cmd, const fr_cli_values *v, const fr_cli_text *t, const char *def, const int **ids,
                       int *n, int **owned)
{
    const fr_opt_value *given = fr_opt_val(v, FR_O_PROMPT_IDS);
    const int text = fr_opt_given(v, FR_O_PROMPT) + fr_opt_given(v, FR_O_PROMPT_TEXT_FILE);
    const int count = text + given->given + fr_opt_given(v, FR_O_PROMPT_FILE);
    *owned = NULL;
    *ids = NULL;
    *n = 0;
    if (count > 1 || (count == 0 && !def))
        return fr_cli_usage_error(cmd, "give %s of --prompt, --prompt-text-file, --prompt-ids and --prompt-file",
                                  def ? "one" : "exactly one");
    if (given->given) {
        *ids = given->ids;
        *n = given->n;
        return 0;
    }
    int rc = 0;
    if (text) rc = prompt_text(cmd, v, t, owned, n);
    else if (fr_opt_given(v, FR_O_PROMPT_FILE) && fr_cli_ids_file(fr_opt_str(v, FR_O_PROMPT_FILE), owned, n))
        rc = fr_cli_fail(cmd, 1);
    else if (!fr_opt_given(v, FR_O_PROMPT_FILE) && fr_parse_ids(def, owned, n))
        rc = fr_cli_fail(cmd, 2);
    *ids = *owned;
    return rc;
}
