/* fp4rollout tokenize and fp4rollout detokenize: a checkpoint's
 * tokenizer.json (tokenizer/tokenizer.h) from the command line, to see the
 * ids a prompt becomes and the text ids stand for. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "base/buf.h"
#include "rollout/engine/session.h"
#include "tokenizer/tokenizer.h"

const char fr_tokenize_usage[] =
    "usage: fp4rollout tokenize --tokenizer PATH (--file F | --text T) [--special]\n"
    "\n"
    "Encodes a text with a Hugging Face tokenizer.json, as the tokenizers library\n"
    "does, and prints one JSON line: {\"ids\": [...]}. Text that is not valid\n"
    "UTF-8 is refused (exit 1).\n";

const char fr_detokenize_usage[] =
    "usage: fp4rollout detokenize --tokenizer PATH --ids LIST [--skip-special]\n"
    "\n"
    "Decodes token ids with a Hugging Face tokenizer.json and prints the text,\n"
    "then a newline. Ids the vocabulary does not hold are skipped, and bytes that\n"
    "do not form UTF-8 print as U+FFFD, as Hugging Face does.\n";

/* The bytes of path ("-": standard input) into b. */
static fr_status read_text(const char *path, fr_buf *b)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!f) return fr_fail(FR_EIO, "cannot open %s", path);
    char chunk[1 << 16];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) fr_buf_put(b, chunk, n);
    int bad = ferror(f);
    if (f != stdin) fclose(f);
    if (bad) return fr_fail(FR_EIO, "cannot read %s", path);
    if (b->failed) return fr_fail(FR_ENOMEM, "out of memory reading %s", path);
    return FR_OK;
}

static int print_ids(const fr_tokenizer *t, const char *text, size_t len, int special)
{
    int *ids;
    size_t n;
    if (fr_tokenizer_encode(t, text, len, special, &ids, &n) != FR_OK) {
        fprintf(stderr, "fp4rollout tokenize: %s\n", fr_last_error());
        return 1;
    }
    fr_buf out = {0};
    fr_buf_put(&out, "{\"ids\": [", 9);
    for (size_t i = 0; i < n; i++) fr_buf_printf(&out, "%s%d", i ? ", " : "", ids[i]);
    fr_buf_put(&out, "]}\n", 3);
    free(ids);
    int rc = out.failed || fwrite(out.data, 1, out.len, stdout) != out.len ? 1 : 0;
    if (rc) fprintf(stderr, "fp4rollout tokenize: cannot write the ids\n");
    fr_buf_free(&out);
    return rc;
}

int fr_cli_tokenize(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_TOKENIZE;
    const char *path = fr_opt_str(v, FR_O_TOKENIZER), *file = fr_opt_str(v, FR_O_TEXT_FILE);
    const char *text = fr_opt_str(v, FR_O_TEXT);
    const int special = fr_opt_int(v, FR_O_SPECIAL);
    if (!file == !text) return fr_cli_usage_error(cmd, "give the text with one of --file and --text");
    fr_buf b = {0};
    fr_tokenizer *t = NULL;
    int rc = 1;
    if (file && read_text(file, &b) != FR_OK) fprintf(stderr, "fp4rollout tokenize: %s\n", fr_last_error());
    else if (fr_tokenizer_load(path, &t) != FR_OK) fprintf(stderr, "fp4rollout tokenize: %s\n", fr_last_error());
    else rc = print_ids(t, file ? (b.data ? b.data : "") : text, file ? b.len : strlen(text), special);
    fr_tokenizer_free(&t);
    fr_buf_free(&b);
    return rc;
}

int fr_cli_detokenize(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_DETOKENIZE;
    const char *path = fr_opt_str(v, FR_O_TOKENIZER), *ids_text = fr_opt_str(v, FR_O_IDS);
    const int skip = fr_opt_int(v, FR_O_SKIP_SPECIAL);
    int *ids = NULL, n = 0;
    if (fr_parse_ids(ids_text, &ids, &n) != FR_OK) return fr_cli_usage_error(cmd, "--ids: %s", fr_last_error());
    fr_tokenizer *t = NULL;
    char *text = NULL;
    size_t len = 0;
    int rc = 1;
    if (fr_tokenizer_load(path, &t) != FR_OK || fr_tokenizer_decode(t, ids, (size_t)n, skip, &text, &len) != FR_OK) {
        fprintf(stderr, "fp4rollout detokenize: %s\n", fr_last_error());
    } else if (fwrite(text, 1, len, stdout) != len || fputc('\n', stdout) == EOF) {
        fprintf(stderr, "fp4rollout detokenize: cannot write the text\n");
    } else {
        rc = 0;
    }
    free(text);
    free(ids);
    fr_tokenizer_free(&t);
    return rc;
}
