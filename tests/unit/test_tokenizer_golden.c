/* The tokenizer against Hugging Face: for every golden file in
 * tests/data/tokenizer/golden (tokenizer_golden.py or golden_node.js wrote
 * them with tokenizers itself) and every text of the corpus, the ids with
 * and without special tokens, the three decodes, the streamed decode, and,
 * where the file has them, transformers' ids from the checkpoint folder.
 * A variant whose tokenizer lives in ../shared and is absent is skipped
 * with a message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/unit/tokenizer_util.h"
#include "tokenizer/tokenizer.h"

#define DATA "tests/data/tokenizer"

typedef struct {
    char file[512];
    int failures;
} golden_case;

/* Compares ids with the golden list; prints the first difference. */
static int same_ids(const char *what, const char *item, const int *ids, size_t n, const cJSON *want)
{
    size_t wn = (size_t)cJSON_GetArraySize(want), i = 0;
    const cJSON *w = want ? want->child : NULL;
    for (; i < n && w; i++, w = w->next)
        if (ids[i] != (int)w->valuedouble) break;
    if (i == n && i == wn) return 1;
    fprintf(stderr, "FAIL %s %s: %zu ids, golden %zu; first difference at %zu: ", what, item, n, wn, i);
    for (size_t k = i >= 3 ? i - 3 : 0; k < i + 4 && k < n; k++) fprintf(stderr, "%s%d", k == i ? "[" : " ", ids[k]);
    fprintf(stderr, " | golden:");
    size_t k = 0;
    for (const cJSON *x = want ? want->child : NULL; x; x = x->next, k++)
        if (k + 3 >= i && k < i + 4) fprintf(stderr, "%s%d", k == i ? " [" : " ", (int)x->valuedouble);
    fprintf(stderr, "\n");
    return 0;
}

static int same_text(const char *what, const char *item, const char *got, size_t n, const cJSON *want)
{
    if (!cJSON_IsString(want)) return 1;   /* not recorded */
    /* A C string of cJSON ends at the first U+0000 of the golden text: the
     * comparison does too (the ids cover the rest). */
    const char *nul = memchr(got, '\0', n);
    size_t cmp = nul ? (size_t)(nul - got) : n;
    if (strlen(want->valuestring) == cmp && memcmp(got, want->valuestring, cmp) == 0) return 1;
    fprintf(stderr, "FAIL %s %s: decoded text differs\n  got:    %.*s\n  golden: %s\n", what, item,
            (int)(n > 300 ? 300 : n), got, want->valuestring);
    return 0;
}

/* ids of the golden list, malloc'd. */
static int *golden_ids(const cJSON *list, size_t *n)
{
    *n = (size_t)cJSON_GetArraySize(list);
    int *v = malloc((*n ? *n : 1) * sizeof *v);
    assert_non_null(v);
    size_t i = 0;
    for (const cJSON *x = list->child; x; x = x->next) v[i++] = (int)x->valuedouble;
    return v;
}

/* Streams ids through the incremental detokenizer: the pieces joined must
 * equal the whole decode, and match the golden chunks when recorded. */
static int check_stream(const fr_tokenizer *t, const char *item, const int *ids, size_t n, const char *whole,
                        size_t whole_len, const cJSON *chunks)
{
    fr_detok *d;
    assert_int_equal(fr_detok_new(t, 0, &d), FR_OK);
    char *joined = malloc(whole_len + 1024);
    size_t len = 0;
    int ok = 1;
    const cJSON *c = chunks ? chunks->child : NULL;
    for (size_t i = 0; i < n && ok; i++) {
        const char *s;
        size_t l;
        if (fr_detok_push(d, ids[i], &s, &l) != FR_OK) {
            fprintf(stderr, "FAIL stream %s: %s\n", item, fr_last_error());
            ok = 0;
            break;
        }
        if (chunks) {
            /* tokenizers' DecodeStream: null where it returned None. */
            int want_none = !c || cJSON_IsNull(c);
            /* cJSON ends a string at an escaped NUL ("\u0000"): a golden
             * chunk holding one is compared up to it (the joined pieces are
             * checked against the whole decode below, NUL included). */
            const size_t gl = want_none ? 0 : strlen(c->valuestring);
            const int cut = !want_none && gl < l && s[gl] == '\0';
            if ((want_none && l) || (!want_none && ((gl != l && !cut) || memcmp(c->valuestring, s, gl)))) {
                fprintf(stderr, "FAIL stream %s: chunk %zu is \"%.*s\", golden %s\n", item, i, (int)l, s,
                        want_none ? "None" : c->valuestring);
                ok = 0;
            }
            if (c) c = c->next;
        }
        if (len + l <= whole_len) memcpy(joined + len, s, l);
        len += l;
    }
    const char *s;
    size_t l;
    if (ok && fr_detok_finish(d, &s, &l) == FR_OK && len + l <= whole_len) {
        memcpy(joined + len, s, l);
        len += l;
    }
    if (ok && (len != whole_len || memcmp(joined, whole, len) != 0)) {
        fprintf(stderr, "FAIL stream %s: the streamed pieces do not add up to the decode\n", item);
        ok = 0;
    }
    free(joined);
    fr_detok_free(&d);
    return ok;
}

/* Texts of the variant whose transformers ids differ from tokenizers';
 * any at all, and transformers is not a witness for the variant. */
static int n_transformers_differ;

/* Whether two JSON arrays of ids are equal (both present). */
static int json_ids_equal(const cJSON *a, const cJSON *b)
{
    if (!a || !b || cJSON_GetArraySize(a) != cJSON_GetArraySize(b)) return 0;
    for (const cJSON *x = a->child, *y = b->child; x && y; x = x->next, y = y->next)
        if (x->valuedouble != y->valuedouble) return 0;
    return 1;
}

/* Every check of one corpus text; returns the number of failures. */
static int check_item(const fr_tokenizer *t, const fr_tokenizer *folder, const char *item, const cJSON *g)
{
    size_t len;
    char *text = fr_test_read_corpus(item, &len);
    int bad = 0, *ids;
    size_t n;
    for (int special = 0; special < 2; special++) {
        assert_int_equal(fr_tokenizer_encode(t, text, len, special, &ids, &n), FR_OK);
        bad += !same_ids(special ? "ids_special" : "ids", item, ids, n,
                         cJSON_GetObjectItem(g, special ? "ids_special" : "ids"));
        free(ids);
        /* transformers' ids are a second witness where its tokenizer is the
         * same as tokenizers' (its plain ids agree): then its special tokens
         * (a bos from tokenizer_config.json) must be ours. Where it built
         * another pipeline (transformers 5 rebuilds DeepSeek-V3's from the
         * LlamaTokenizerFast class its config names), the text's ids differ
         * from tokenizers' and the ground truth is tokenizers alone. */
        const cJSON *tf = cJSON_GetObjectItem(g, special ? "transformers_ids_special" : "transformers_ids");
        if (n_transformers_differ) tf = NULL;
        if (folder && tf) {
            assert_int_equal(fr_tokenizer_encode(folder, text, len, special, &ids, &n), FR_OK);
            bad += !same_ids(special ? "transformers_ids_special" : "transformers_ids", item, ids, n, tf);
            free(ids);
        }
    }
    static const char *const decodes[][2] = {{"ids", "decoded"}, {"ids_special", "decoded_special"},
                                             {"ids_special", "decoded_skip"}};
    for (int k = 0; k < 3; k++) {
        int *g_ids = golden_ids(cJSON_GetObjectItem(g, decodes[k][0]), &n);
        char *s;
        size_t sl;
        assert_int_equal(fr_tokenizer_decode(t, g_ids, n, k == 2, &s, &sl), FR_OK);
        bad += !same_text(decodes[k][1], item, s, sl, cJSON_GetObjectItem(g, decodes[k][1]));
        if (k == 1) bad += !check_stream(t, item, g_ids, n, s, sl, cJSON_GetObjectItem(g, "stream"));
        free(s);
        free(g_ids);
    }
    free(text);
    return bad;
}

static void test_golden(void **state)
{
    golden_case *c = *state;
    cJSON *g = fr_test_read_json(c->file);
    const char *name = cJSON_GetObjectItem(g, "name")->valuestring;
    const char *base = cJSON_GetObjectItem(g, "base")->valuestring;
    const cJSON *patches = cJSON_GetObjectItem(g, "patches");
    fr_tokenizer *t = fr_test_tokenizer_variant(base, patches);
    if (!t) {
        cJSON_Delete(g);
        skip();
    }
    /* The checkpoint folder with its tokenizer_config.json, for transformers' ids. */
    fr_tokenizer *folder = NULL;
    if (cJSON_GetArraySize(patches) == 0) folder = fr_test_tokenizer_folder(base);
    const cJSON *vs = cJSON_GetObjectItem(g, "vocab_size");
    int bad = 0, items = 0;
    if (vs && fr_tokenizer_vocab_size(t) != (int)vs->valuedouble) {
        fprintf(stderr, "FAIL %s: vocab size %d, golden %d\n", name, fr_tokenizer_vocab_size(t), (int)vs->valuedouble);
        bad++;
    }
    n_transformers_differ = 0;
    for (const cJSON *it = cJSON_GetObjectItem(g, "items")->child; it; it = it->next) {
        const cJSON *tf = cJSON_GetObjectItem(it, "transformers_ids");
        n_transformers_differ += tf && !json_ids_equal(tf, cJSON_GetObjectItem(it, "ids"));
    }
    for (const cJSON *it = cJSON_GetObjectItem(g, "items")->child; it; it = it->next, items++)
        bad += check_item(t, folder, it->string, it);
    printf("%s: %d texts, %d failures (%s)\n", name, items, bad, cJSON_GetObjectItem(g, "source")->valuestring);
    if (n_transformers_differ)
        printf("  %s: transformers' own ids differ from tokenizers' on %d texts (another pipeline): its ids are "
               "not checked for this variant\n", name, n_transformers_differ);
    fr_tokenizer_free(&t);
    fr_tokenizer_free(&folder);
    cJSON_Delete(g);
    assert_int_equal(bad, 0);
}

int main(void)
{
    DIR *d = opendir(DATA "/golden");
    if (!d) {
        fprintf(stderr, "FAIL: %s/golden not found (run the tests from the repository root)\n", DATA);
        return 1;
    }
    golden_case cases[64];
    struct CMUnitTest tests[64];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64) {
        size_t l = strlen(e->d_name);
        if (l < 6 || strcmp(e->d_name + l - 5, ".json") != 0) continue;
        snprintf(cases[n].file, sizeof cases[n].file, "%s/golden/%s", DATA, e->d_name);
        tests[n] = (struct CMUnitTest){strdup(e->d_name), test_golden, NULL, NULL, &cases[n]};
        n++;
    }
    closedir(d);
    int rc = _cmocka_run_group_tests("tokenizer_golden", tests, (size_t)n, NULL, NULL);
    for (int i = 0; i < n; i++) free((char *)tests[i].name);
    return rc;
}
