#include "tokenizer_util.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

char *fr_test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s (the tests run from the repository root)", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    b[n] = '\0';
    *len = (size_t)n;
    return b;
}

char *fr_test_read_corpus(const char *name, size_t *len)
{
    char path[512];
    snprintf(path, sizeof path, "tests/data/tokenizer/corpus/%s.txt", name);
    return fr_test_read_file(path, len);
}

cJSON *fr_test_read_json(const char *path)
{
    size_t len;
    char *text = fr_test_read_file(path, &len);
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    if (!j) fail_msg("%s is not valid JSON", path);
    return j;
}

const char *fr_test_tokenizers_dir(void)
{
    const char *env = getenv("FR_TOKENIZERS_DIR");
    return env && *env ? env : "../shared/tokenizers";
}

const char *fr_test_tokenizer_base_dir(const char *base)
{
    static char dir[1024];
    struct stat st;
    if (strncmp(base, "shared:", 7) == 0) {
        snprintf(dir, sizeof dir, "%s/%s", fr_test_tokenizers_dir(), base + 7);
    } else if (strncmp(base, "data:", 5) == 0) {
        snprintf(dir, sizeof dir, "tests/data/tokenizer/%s", base + 5);
    } else {
        fail_msg("unknown tokenizer base \"%s\"", base);
    }
    char probe[1100];
    snprintf(probe, sizeof probe, "%s/tokenizer.json", dir);
    if (stat(probe, &st) != 0) {
        fprintf(stderr, "SKIP: %s not found (set FR_TOKENIZERS_DIR or place the tokenizers at ../shared/tokenizers)\n",
                probe);
        return NULL;
    }
    return dir;
}

/* Sets the value at path (keys and indices) in root to a copy of value. */
static void patch(cJSON *root, const cJSON *path, const cJSON *value)
{
    cJSON *o = root;
    int n = cJSON_GetArraySize(path), i = 0;
    for (const cJSON *k = path->child; k; k = k->next, i++) {
        cJSON *copy = i == n - 1 ? cJSON_Duplicate(value, 1) : NULL;
        if (cJSON_IsString(k)) {
            if (copy) {
                if (cJSON_GetObjectItemCaseSensitive(o, k->valuestring)) cJSON_ReplaceItemInObjectCaseSensitive(o, k->valuestring, copy);
                else cJSON_AddItemToObject(o, k->valuestring, copy);
            } else {
                o = cJSON_GetObjectItemCaseSensitive(o, k->valuestring);
            }
        } else {
            if (copy) cJSON_ReplaceItemInArray(o, (int)k->valuedouble, copy);
            else o = cJSON_GetArrayItem(o, (int)k->valuedouble);
        }
        if (!o) fail_msg("a patch path does not exist in the tokenizer");
    }
}

fr_tokenizer *fr_test_tokenizer_variant(const char *base, const cJSON *patches)
{
    const char *dir = fr_test_tokenizer_base_dir(base);
    if (!dir) return NULL;
    char path[1100];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    fr_tokenizer *t = NULL;
    if (cJSON_GetArraySize(patches) == 0) {
        if (fr_tokenizer_load_opts(path, FR_TOK_NO_CONFIG, &t) != FR_OK) fail_msg("load %s: %s", path, fr_last_error());
        return t;
    }
    cJSON *root = fr_test_read_json(path);
    for (const cJSON *p = patches->child; p; p = p->next) patch(root, p->child, p->child->next);
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    assert_non_null(json);
    if (fr_tokenizer_from_json(json, strlen(json), NULL, 0, path, &t) != FR_OK)
        fail_msg("load patched %s: %s", path, fr_last_error());
    free(json);
    return t;
}

fr_tokenizer *fr_test_tokenizer_folder(const char *base)
{
    const char *dir = fr_test_tokenizer_base_dir(base);
    fr_tokenizer *t = NULL;
    if (dir && fr_tokenizer_load(dir, &t) != FR_OK) fail_msg("load %s: %s", dir, fr_last_error());
    return t;
}
