/* The option table (app/options.def) against every place derived from it:
 * the rows are consistent (names unique per command, defaults valid,
 * configuration places of the right size); every command's getopt table
 * takes exactly its rows; every command's --help lists exactly its rows
 * (serve's with their keys) and names no option the table lacks; every
 * key is read by the configuration reader, refused with its path when of
 * the wrong type, written back by fr_serve_config_to_json and documented
 * in configs/README.md; every serve flag has a key and sets exactly what
 * the key sets; and the configuration's defaults are the table's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "app/cli.h"
#include "app/client_cli.h"
#include "app/serve_flags.h"
#include "app/serve_keys.h"
#include "base/log.h"
#include "test_util.h"

#define KEY40 "0123456789abcdefghijklmnopqrstuvwxyzABCD"

/* A valid command-line value of row r other than its default (NULL for a flag). */
static const char *sample(int r, char *buf, size_t cap)
{
    const fr_opt *o = &fr_opts[r];
    static const char *const choices[] = {"cuda", "nvfp4", "exact", "mxfp4", "wait", "bf16", "debug"};
    switch (o->type) {
    case FR_OPT_FLAG: return NULL;
    case FR_OPT_INT:
    case FR_OPT_LONG: snprintf(buf, cap, "%.0f", floor((o->lo + o->hi) / 2)); return buf;
    case FR_OPT_NUM:
    case FR_OPT_FLOAT: snprintf(buf, cap, "%.17g", (o->lo + o->hi) / 2); return buf;
    case FR_OPT_SEED: return "12345";
    case FR_OPT_STR: return "sample-value";
    case FR_OPT_RECIPE: return "full,-rotate";
    case FR_OPT_IDS: return "3,4";
    case FR_OPT_FILES: return "a.txt";
    case FR_OPT_KEY:
    case FR_OPT_KEYS: return KEY40;
    case FR_OPT_CHOICE:
        for (size_t k = 0; k < sizeof choices / sizeof choices[0]; k++) {
            int v = 0, d = -1;
            if (o->choice.parse(choices[k], &v) == FR_OK && (!o->def || (o->choice.parse(o->def, &d), v != d)))
                return choices[k];
        }
        return NULL;
    }
    return NULL;
}

/* fr_cli_parse with stderr sent to /dev/null: usage errors are expected. */
static int quiet_parse(fr_cmd cmd, int n, char **argv, fr_cli_values **v)
{
    fflush(stderr);
    int saved = dup(fileno(stderr));
    FILE *null = fopen("/dev/null", "w");
    dup2(fileno(null), fileno(stderr));
    int rc = 0;
    *v = NULL;
    if (!fr_cli_parse(cmd, "", n, argv, v, &rc)) rc = 0;
    fflush(stderr);
    dup2(saved, fileno(stderr));
    close(saved);
    fclose(null);
    return rc;
}

/* ---- the rows ------------------------------------------------------------ */

static size_t storage_of(fr_opt_type t)
{
    switch (t) {
    case FR_OPT_FLAG:
    case FR_OPT_INT:
    case FR_OPT_CHOICE:
    case FR_OPT_IDS: return sizeof(int);
    case FR_OPT_LONG: return sizeof(long long);
    case FR_OPT_NUM: return sizeof(double);
    case FR_OPT_FLOAT: return sizeof(float);
    case FR_OPT_SEED: return sizeof(uint64_t);
    case FR_OPT_RECIPE: return sizeof(fr_recipe);
    case FR_OPT_KEY:
    case FR_OPT_KEYS: return FR_SERVE_CURVE_KEY;
    default: return 0;   /* strings: any size */
    }
}

static void test_rows(void **state)
{
    (void)state;
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        if (o->name && (!o->help || !o->cmds)) fail_msg("row %d (--%s) has no help or no command", r, o->name);
        if (!o->name && (!o->key || o->cmds)) fail_msg("row %d has neither a name nor a key", r);
        if (o->required & ~o->cmds) fail_msg("--%s is required where it is not taken", o->name);
        if (o->type == FR_OPT_CHOICE && !o->choice.parse) fail_msg("--%s: a choice without a parser", o->name);
        if (o->type == FR_OPT_CHOICE && o->key && !o->choice.name) fail_msg("%s: a key that cannot be written", o->key);
        if (o->def) {
            fr_opt_value v = {0};
            if (fr_opt_from_text(o, "default", o->def, &v)) fail_msg("row %d: %s", r, fr_last_error());
            fr_opt_value_clear(&v);
        }
        if (!o->key) continue;
        const size_t want = storage_of(o->type);
        if ((want && o->size != want) || (!want && o->size < 2) || o->at + o->size > sizeof(fr_serve_config))
            fail_msg("%s: its place in fr_serve_config does not fit a %d value (%zu bytes)", o->key, (int)o->type,
                     o->size);
        const int listed = o->type == FR_OPT_IDS || o->type == FR_OPT_FILES || o->type == FR_OPT_KEYS;
        if ((listed || o->type == FR_OPT_SEED) && (!o->count_at || (listed && o->n_max < 1)))
            fail_msg("%s: a list without its count", o->key);
    }
    /* No command takes a name, alias or short name twice. */
    for (int cmd = 0; cmd < FR_CMD_COUNT; cmd++)
        for (int a = 0; a < FR_O_COUNT; a++)
            for (int b = a + 1; b < FR_O_COUNT; b++) {
                const fr_opt *x = &fr_opts[a], *y = &fr_opts[b];
                if (!fr_opt_takes(x, (fr_cmd)cmd) || !fr_opt_takes(y, (fr_cmd)cmd)) continue;
                const char *xs[] = {x->name, x->alias}, *ys[] = {y->name, y->alias};
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 2; j++)
                        if (xs[i] && ys[j] && strcmp(xs[i], ys[j]) == 0)
                            fail_msg("%s takes --%s twice", fr_cmd_name((fr_cmd)cmd), xs[i]);
                if (x->short_name && x->short_name == y->short_name)
                    fail_msg("%s takes -%c twice", fr_cmd_name((fr_cmd)cmd), x->short_name);
            }
}

/* ---- the command line ---------------------------------------------------- */

/* argv for cmd giving row r (by its name, or its alias), after the
 * options cmd requires. */
static int argv_for(fr_cmd cmd, int r, int alias, char **argv, char bufs[][64])
{
    int n = 0, b = 0;
    argv[n++] = (char *)fr_cmd_name(cmd);
    for (int q = 0; q < FR_O_COUNT; q++) {
        const fr_opt *o = &fr_opts[q];
        if (q != r && !(fr_opt_takes(o, cmd) && (o->required >> cmd & 1u))) continue;
        snprintf(bufs[b], 64, "--%s", q == r && alias ? o->alias : o->name);
        argv[n++] = bufs[b++];
        const char *val = sample(q, bufs[b], 64);
        if (val) argv[n++] = (char *)val;
        b++;
    }
    argv[n] = NULL;
    return n;
}

/* Whether a long option of cmd begins with name (getopt takes a prefix). */
static int prefix_of_any(fr_cmd cmd, const char *name)
{
    for (int q = 0; q < FR_O_COUNT; q++) {
        const fr_opt *o = &fr_opts[q];
        if (!fr_opt_takes(o, cmd)) continue;
        if (strncmp(o->name, name, strlen(name)) == 0) return 1;
        if (o->alias && strncmp(o->alias, name, strlen(name)) == 0) return 1;
    }
    return 0;
}

static void test_getopt_tables(void **state)
{
    (void)state;
    char *argv[128], bufs[128][64];
    for (int cmd = 0; cmd < FR_CMD_COUNT; cmd++)
        for (int r = 0; r < FR_O_COUNT; r++) {
            const fr_opt *o = &fr_opts[r];
            if (!o->name || r == FR_O_HELP) continue;
            for (int alias = 0; alias <= (o->alias != NULL); alias++) {
                const int n = argv_for((fr_cmd)cmd, r, alias, argv, bufs);
                fr_cli_values *v;
                const int rc = quiet_parse((fr_cmd)cmd, n, argv, &v);
                const char *name = alias ? o->alias : o->name;
                if (fr_opt_takes(o, (fr_cmd)cmd) && (rc != 0 || !fr_opt_given(v, (fr_opt_id)r)))
                    fail_msg("%s --%s: not taken (status %d)", fr_cmd_name((fr_cmd)cmd), name, rc);
                if (!fr_opt_takes(o, (fr_cmd)cmd) && !prefix_of_any((fr_cmd)cmd, name) && rc != 2)
                    fail_msg("%s --%s: taken, but the table does not give it to this command",
                             fr_cmd_name((fr_cmd)cmd), name);
            }
        }
    fr_log_set_level(FR_LOG_INFO);
    fr_cli_args_release();
}

/* ---- --help -------------------------------------------------------------- */

/* The --names of the option lines ("  --kv T, --kv-cache-dtype T   ...") of
 * a help text, as " name name ..." */
static void listed_names(const char *text, char *out, size_t cap)
{
    out[0] = '\0';
    for (const char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (strncmp(line, "  -", 3) != 0) continue;
        const char *end = strstr(line, "   "), *eol = strchr(line, '\n');
        if (!end || (eol && eol < end)) end = eol ? eol : line + strlen(line);
        for (const char *p = strstr(line, "--"); p && p < end; p = strstr(p + 2, "--")) {
            size_t len = strspn(p + 2, "abcdefghijklmnopqrstuvwxyz0123456789-");
            snprintf(out + strlen(out), cap - strlen(out), " %.*s", (int)len, p + 2);
        }
    }
    strncat(out, " ", cap - strlen(out) - 1);
}

static char *capture(void (*print)(FILE *, fr_cmd, const char *), fr_cmd cmd, const char *usage)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    print(f, cmd, usage);
    fclose(f);
    return text;
}

/* Every "--word" of text is an option of some row. */
static void names_known(const char *what, const char *text)
{
    for (const char *p = strstr(text, "--"); p; p = strstr(p + 2, "--")) {
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)strspn(p + 2, "abcdefghijklmnopqrstuvwxyz0123456789-"), p + 2);
        if (!name[0] || (p > text && p[-1] != ' ' && p[-1] != '[' && p[-1] != '(' && p[-1] != '`')) continue;
        int known = 0;
        for (int r = 0; r < FR_O_COUNT && !known; r++)
            known = fr_opts[r].name && (strcmp(fr_opts[r].name, name) == 0 ||
                                        (fr_opts[r].alias && strcmp(fr_opts[r].alias, name) == 0));
        if (!known) fail_msg("%s names --%s, which no row of the option table has", what, name);
    }
}

static void check_help(fr_cmd cmd, const char *usage, const char *what)
{
    char *text = capture(fr_cli_help, cmd, usage);
    char listed[8192], want[8192] = " ";
    listed_names(text, listed, sizeof listed);
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        if (!fr_opt_takes(o, cmd)) continue;
        char one[80];
        snprintf(one, sizeof one, " %s ", o->name);
        if (!strstr(listed, one)) fail_msg("%s --help does not list --%s", what, o->name);
        snprintf(want + strlen(want), sizeof want - strlen(want), "%s %s%s", o->name, o->alias ? o->alias : "",
                 o->alias ? " " : "");
        if (o->alias) {
            snprintf(one, sizeof one, " %s ", o->alias);
            if (!strstr(listed, one)) fail_msg("%s --help does not list --%s", what, o->alias);
        }
        char key[96];
        snprintf(key, sizeof key, "[%s]", o->key ? o->key : "");
        if (cmd == FR_CMD_SERVE && o->key && !strstr(text, key)) fail_msg("serve --help does not show %s", key);
    }
    /* and nothing else */
    for (char *p = strtok(listed, " "); p; p = strtok(NULL, " ")) {
        char one[80];
        snprintf(one, sizeof one, " %s ", p);
        if (!strstr(want, one)) fail_msg("%s --help lists --%s, which it does not take", what, p);
    }
    names_known(what, text);
    free(text);
}

static void print_options(FILE *f, fr_cmd cmd, const char *usage)
{
    fputs(usage, f);
    fr_cli_print_options(f, cmd, "", cmd == FR_CMD_CLIENT);
}

static void test_help(void **state)
{
    (void)state;
    int seen[FR_CMD_COUNT] = {0};
    for (int i = 0; i < fr_cli_n_commands; i++) {
        check_help(fr_cli_commands[i].cmd, fr_cli_commands[i].usage, fr_cli_commands[i].name);
        seen[fr_cli_commands[i].cmd] = 1;
    }
    /* fp4rollout-client: the options before the command and each command's. */
    char *whole = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&whole, &len);
    fr_client_help(f);
    fclose(f);
    names_known("fp4rollout-client --help", whole);
    for (int i = 0; i < fr_client_n_commands; i++) {
        const fr_client_command *k = &fr_client_commands[i];
        char *text = capture(print_options, k->cmd, "");
        char listed[4096];
        listed_names(text, listed, sizeof listed);
        for (int r = 0; r < FR_O_COUNT; r++) {
            char one[80];
            snprintf(one, sizeof one, " %s ", fr_opts[r].name ? fr_opts[r].name : "");
            const int common = fr_opts[r].group == FR_OG_COMMON;
            if (fr_opt_takes(&fr_opts[r], k->cmd) && !common && !strstr(listed, one))
                fail_msg("fp4rollout-client %s: --%s not listed", k->name, fr_opts[r].name);
        }
        if (!strstr(whole, k->synopsis)) fail_msg("fp4rollout-client --help lacks %s", k->synopsis);
        free(text);
        seen[k->cmd] = 1;
    }
    check_help(FR_CMD_CLIENT, "", "fp4rollout-client");
    seen[FR_CMD_CLIENT] = 1;
    for (int cmd = 0; cmd < FR_CMD_COUNT; cmd++)
        if (!seen[cmd]) fail_msg("command %d has no --help", cmd);
    free(whole);
}

/* ---- the serve configuration --------------------------------------------- */

/* The row's sample as the configuration's JSON, through a configuration. */
static cJSON *sample_json(int r)
{
    char buf[64];
    fr_opt_value v = {0};
    fr_serve_config c;
    fr_serve_config_default(&c);
    if (fr_opt_from_text(&fr_opts[r], "sample", sample(r, buf, sizeof buf), &v))
        fail_msg("%s: %s", fr_opts[r].key, fr_last_error());
    fr_serve_key_store(&fr_opts[r], &v, &c);
    fr_opt_value_clear(&v);
    return fr_serve_key_json(&fr_opts[r], &c);
}

/* root["a"]["b"] = item for key "a.b", making the objects on the way. */
static void put(cJSON *root, const char *key, cJSON *item)
{
    const char *dot = strchr(key, '.');
    if (!dot) {
        cJSON_DeleteItemFromObjectCaseSensitive(root, key);
        cJSON_AddItemToObject(root, key, item);
        return;
    }
    char name[48];
    snprintf(name, sizeof name, "%.*s", (int)(dot - key), key);
    cJSON *obj = cJSON_GetObjectItemCaseSensitive(root, name);
    put(obj ? obj : cJSON_AddObjectToObject(root, name), dot + 1, item);
}

/* What a key needs beside it to pass the checks across keys. */
static cJSON *companions(const char *key)
{
    const char *text = strcmp(key, "curve.server_secret_key_file") == 0
                           ? "{\"curve\": {\"client_public_keys\": [\"" KEY40 "\"]}}"
                       : strncmp(key, "curve.", 6) == 0
                           ? "{\"curve\": {\"server_secret_key\": \"" KEY40 "\", \"client_public_keys\": [\"" KEY40 "\"]}}"
                       : strncmp(key, "recalibration.", 14) == 0
                           ? "{\"recalibration\": {\"kl_threshold\": 0.5, \"texts\": [\"a.txt\"]}}"
                           : "{}";
    return cJSON_Parse(text);
}

static fr_status parse_json(cJSON *root, fr_serve_config *c)
{
    char *text = cJSON_PrintUnformatted(root);
    fr_serve_config_default(c);
    fr_status st = fr_serve_config_parse(text, strlen(text), "test.json", c);
    free(text);
    return st;
}

static void test_config_keys(void **state)
{
    (void)state;
    for (int r = 0; r < FR_O_COUNT; r++) {
        const char *key = fr_opts[r].key;
        if (!key) continue;
        /* read, into the place the writer writes from */
        cJSON *root = companions(key), *item = sample_json(r);
        put(root, key, cJSON_Duplicate(item, 1));
        fr_serve_config c;
        if (parse_json(root, &c)) fail_msg("%s: the reader refuses its sample: %s", key, fr_last_error());
        cJSON *back = fr_serve_key_json(&fr_opts[r], &c);
        if (!cJSON_Compare(item, back, 1)) fail_msg("%s: read back differently", key);
        cJSON_Delete(back);
        /* refused, with its path, when of the wrong type */
        put(root, key, cJSON_CreateObject());
        char want[160];
        snprintf(want, sizeof want, "test.json: %s: expected", key);
        if (parse_json(root, &c) != FR_EINVAL || !strstr(fr_last_error(), want))
            fail_msg("%s: an object for it gave \"%s\"", key, fr_last_error());
        cJSON_Delete(root);
        cJSON_Delete(item);
    }
}

static void test_defaults_and_writer(void **state)
{
    (void)state;
    fr_serve_config c;
    fr_serve_config_default(&c);
    /* The defaults are the table's. */
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        if (!o->key || !o->def) continue;
        fr_serve_config d;
        fr_opt_value v = {0};
        memcpy(&d, &c, sizeof d);
        assert_int_equal(fr_opt_from_text(o, "default", o->def, &v), FR_OK);
        fr_serve_key_store(o, &v, &d);
        fr_opt_value_clear(&v);
        if (memcmp(&c, &d, sizeof c) != 0) fail_msg("%s: the configuration's default is not the table's %s", o->key, o->def);
    }
    assert_int_equal(c.metrics_port, FR_METRICS_PORT_DEFAULT);
    /* The writer writes every key when none is left out. */
    const char *full = "{\"curve\": {\"server_secret_key\": \"" KEY40 "\", \"client_public_keys\": [\"" KEY40 "\"], "
                       "\"trainer_public_keys\": [\"" KEY40 "\"]}, \"recalibration\": {\"kl_threshold\": 0.5, "
                       "\"texts\": [\"a.txt\"], \"context\": 64}, \"metrics_port\": 9000}";
    assert_int_equal(fr_serve_config_parse(full, strlen(full), "full", &c), FR_OK);
    char *json = NULL;
    assert_int_equal(fr_serve_config_to_json(&c, &json), FR_OK);
    cJSON *root = cJSON_Parse(json);
    for (int r = 0; r < FR_O_COUNT; r++) {
        const char *key = fr_opts[r].key;
        if (!key) continue;
        const char *dot = strchr(key, '.');
        char obj[48];
        snprintf(obj, sizeof obj, "%.*s", dot ? (int)(dot - key) : 0, key);
        const cJSON *at = dot ? cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, obj), dot + 1)
                              : cJSON_GetObjectItemCaseSensitive(root, key);
        if (!at) fail_msg("fr_serve_config_to_json leaves out %s:\n%s", key, json);
    }
    cJSON_Delete(root);
    free(json);
}

static void test_serve_flags(void **state)
{
    (void)state;
    char *argv[10], flag[64], buf[64];
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        const int serve = fr_opt_takes(o, FR_CMD_SERVE);
        if (serve && !o->key && r != FR_O_CONFIG && o->group != FR_OG_COMMON)
            fail_msg("serve --%s sets no configuration key", o->name);
        if (o->name && o->key && !serve) fail_msg("--%s has a key but is no serve flag", o->name);
        if (!serve || !o->key) continue;
        /* the flag, then its value written as the key's JSON and read back: the same configuration */
        int n = 0;
        snprintf(flag, sizeof flag, "--%s", o->name);
        argv[n++] = "serve";
        /* a CURVE flag passes the checks across keys beside a secret key
         * (its file) and a client's key, as a curve key does */
        const int curve = strncmp(o->key, "curve.", 6) == 0, key_file = r == FR_O_CURVE_SERVER_KEY_FILE;
        if (curve) {
            argv[n++] = key_file ? "--client-keys" : "--curve-secret-key-file";
            argv[n++] = key_file ? KEY40 : "key.json";
        }
        argv[n++] = flag;
        const char *val = sample(r, buf, sizeof buf);
        if (val) argv[n++] = (char *)val;
        argv[n] = NULL;
        fr_cli_values *v;
        assert_int_equal(quiet_parse(FR_CMD_SERVE, n, argv, &v), 0);
        fr_serve_config a, b, d;
        fr_serve_config_default(&a);
        fr_serve_config_default(&d);
        if (fr_serve_flags_apply(v, &a)) fail_msg("serve %s: %s", flag, fr_last_error());
        if (memcmp(&a, &d, sizeof a) == 0) fail_msg("serve %s %s changed nothing", flag, val ? val : "");
        cJSON *root = cJSON_CreateObject();
        if (curve && key_file) put(root, "curve.client_public_keys", cJSON_CreateStringArray((const char *[]){KEY40}, 1));
        if (curve && !key_file) put(root, "curve.server_secret_key_file", cJSON_CreateString("key.json"));
        put(root, o->key, fr_serve_key_json(o, &a));
        assert_int_equal(parse_json(root, &b), FR_OK);
        if (memcmp(&a, &b, sizeof a) != 0) fail_msg("serve %s sets other than the key %s does", flag, o->key);
        cJSON_Delete(root);
    }
    fr_cli_args_release();
}

/* configs/README.md lists every key and every serve flag, and no key the
 * table lacks. */
static void test_documented(void **state)
{
    (void)state;
    FILE *f = fopen("configs/README.md", "r");
    assert_non_null(f);
    static char doc[1 << 17];
    size_t n = fread(doc, 1, sizeof doc - 1, f);
    doc[n] = '\0';
    fclose(f);
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        char want[96];
        if (o->key) {
            snprintf(want, sizeof want, "\n| `%s` |", o->key);
            if (!strstr(doc, want)) fail_msg("configs/README.md does not document the key %s", o->key);
        }
        if (o->key && fr_opt_takes(o, FR_CMD_SERVE)) {
            snprintf(want, sizeof want, "`--%s", o->name);
            if (!strstr(doc, want)) fail_msg("configs/README.md does not list the flag --%s", o->name);
        }
    }
    const char *keys = strstr(doc, "\n## Keys");
    assert_non_null(keys);
    const char *end = strstr(keys + 1, "\n## ");
    for (const char *p = strstr(keys, "\n| `"); p && (!end || p < end); p = strstr(p + 1, "\n| `")) {
        char key[96];
        snprintf(key, sizeof key, "%.*s", (int)strcspn(p + 4, "`"), p + 4);
        int known = 0;
        for (int r = 0; r < FR_O_COUNT && !known; r++)
            known = fr_opts[r].key && (strcmp(fr_opts[r].key, key) == 0 ||
                                       (strncmp(fr_opts[r].key, key, strlen(key)) == 0 && fr_opts[r].key[strlen(key)] == '.'));
        if (!known) fail_msg("configs/README.md documents %s, which no row of the option table has", key);
    }
}

FR_TEST_MAIN(NULL, NULL,
             cmocka_unit_test(test_rows),
             cmocka_unit_test(test_getopt_tables),
             cmocka_unit_test(test_help),
             cmocka_unit_test(test_config_keys),
             cmocka_unit_test(test_defaults_and_writer),
             cmocka_unit_test(test_serve_flags),
             cmocka_unit_test(test_documented))
