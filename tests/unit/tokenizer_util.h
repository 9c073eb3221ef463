/* Helpers of the tokenizer tests: the corpus, the golden files, and the
 * tokenizers they name (tests/data/tokenizer/README.md). */
#ifndef FR_TEST_TOKENIZER_UTIL_H
#define FR_TEST_TOKENIZER_UTIL_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "tokenizer/tokenizer.h"

/* A whole file, malloc'd and NUL-terminated; fails the test when unreadable. */
char *fr_test_read_file(const char *path, size_t *len);
/* tests/data/tokenizer/corpus/NAME.txt. */
char *fr_test_read_corpus(const char *name, size_t *len);
cJSON *fr_test_read_json(const char *path);

/* The folder of the checkpoints' tokenizers: $FR_TOKENIZERS_DIR, else
 * ../shared/tokenizers. */
const char *fr_test_tokenizers_dir(void);

/* The folder of a golden file's base ("shared:qwen3", "data:spm_bpe"), or
 * NULL with a SKIP message when it is absent. The string is overwritten by
 * the next call. */
const char *fr_test_tokenizer_base_dir(const char *base);

/* The tokenizer.json of base with the patches applied ([path, value]
 * pairs), loaded without tokenizer_config.json as tokenizers loads it; NULL
 * (after a SKIP message) when base is absent. */
fr_tokenizer *fr_test_tokenizer_variant(const char *base, const cJSON *patches);

/* base's folder loaded as a checkpoint's (tokenizer_config.json too), or NULL. */
fr_tokenizer *fr_test_tokenizer_folder(const char *base);

#endif
