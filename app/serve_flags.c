/* The flags of `fp4rollout serve`: each one names a key of the serve
 * configuration (configs/README.md), so `serve --model M --kv nvfp4 --port P`
 * needs no file, and with --config the flags override the file's values.
 * The flags become one JSON object, parsed over the configuration by the
 * same strict parser as a file, so a flag's value is checked exactly as the
 * key's is. */
#include "app/serve_flags.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

enum kind { STR, INT, NUM, FLAG };

static const struct {
    const char *flag, *object, *key;   /* object: NULL for a top-level key */
    enum kind kind;
} map[] = {
    {"model", NULL, "model", STR},           {"backend", NULL, "backend", STR},
    {"kv", NULL, "kv_dtype", STR},           {"fp4-compute", NULL, "fp4_compute", STR},
    {"recipe", NULL, "recipe", STR},         {"calib", NULL, "calib", STR},
    {"tp", NULL, "tp", INT},                 {"max-seqs", NULL, "max_seqs", INT},
    {"kv-blocks", NULL, "kv_blocks", INT},   {"chunk", NULL, "chunk", INT},
    {"max-model-len", NULL, "max_model_len", INT}, {"deterministic", NULL, "deterministic", FLAG},
    {"bind", "coordinator", "bind", STR},    {"port", "coordinator", "port", INT},
    {"metrics-port", NULL, "metrics_port", INT}, {"metrics-pub-port", NULL, "metrics_pub_port", INT},
    {"kl-sample-rate", NULL, "kl_sample_rate", NUM}, {"log-stats-interval", NULL, "log_stats_interval_s", NUM},
    {"temperature", "sampling", "temperature", NUM}, {"top-p", "sampling", "top_p", NUM},
    {"top-k", "sampling", "top_k", INT},     {"max-tokens", "sampling", "max_tokens", INT},
};
enum { N_MAP = sizeof map / sizeof map[0] };

const struct option fr_serve_longopts[] = {
    {"config", required_argument, 0, 0},      {"model", required_argument, 0, 0},
    {"backend", required_argument, 0, 0},     {"kv", required_argument, 0, 0},
    {"fp4-compute", required_argument, 0, 0}, {"recipe", required_argument, 0, 0},
    {"calib", required_argument, 0, 0},       {"tp", required_argument, 0, 0},
    {"max-seqs", required_argument, 0, 0},    {"kv-blocks", required_argument, 0, 0},
    {"chunk", required_argument, 0, 0},       {"max-model-len", required_argument, 0, 0},
    {"deterministic", no_argument, 0, 0},     {"bind", required_argument, 0, 0},
    {"port", required_argument, 0, 0},        {"metrics-port", required_argument, 0, 0},
    {"metrics-pub-port", required_argument, 0, 0}, {"kl-sample-rate", required_argument, 0, 0},
    {"log-stats-interval", required_argument, 0, 0},
    {"temperature", required_argument, 0, 0}, {"top-p", required_argument, 0, 0},
    {"top-k", required_argument, 0, 0},       {"max-tokens", required_argument, 0, 0},
    {0, 0, 0, 0},
};

static cJSON *object_for(cJSON *root, const char *name)
{
    if (!name) return root;
    cJSON *o = cJSON_GetObjectItemCaseSensitive(root, name);
    return o ? o : cJSON_AddObjectToObject(root, name);
}

/* Adds one flag's value under its key; a number must be one whole. */
static fr_status add(cJSON *root, int m, const char *value)
{
    cJSON *o = object_for(root, map[m].object);
    cJSON_DeleteItemFromObjectCaseSensitive(o, map[m].key);   /* the last of a repeated flag wins */
    if (map[m].kind == FLAG) return cJSON_AddTrueToObject(o, map[m].key) ? FR_OK : fr_fail(FR_ENOMEM, "out of memory");
    if (map[m].kind == STR)
        return cJSON_AddStringToObject(o, map[m].key, value) ? FR_OK : fr_fail(FR_ENOMEM, "out of memory");
    char *end = NULL;
    errno = 0;
    double v = strtod(value, &end);
    if (!*value || *end || errno)
        return fr_fail(FR_EINVAL, "--%s expects %s, got '%s'", map[m].flag, map[m].kind == INT ? "an integer" : "a number",
                       value);
    return cJSON_AddNumberToObject(o, map[m].key, v) ? FR_OK : fr_fail(FR_ENOMEM, "out of memory");
}

static fr_status flags_to_json(int argc, char **argv, char **json)
{
    cJSON *root = cJSON_CreateObject();
    fr_status st = root ? FR_OK : fr_fail(FR_ENOMEM, "out of memory");
    for (int i = 1; !st && i < argc; i++) {
        if (strncmp(argv[i], "--", 2) != 0) {
            st = fr_fail(FR_EINVAL, "unexpected argument '%s'", argv[i]);
            break;
        }
        int m = 0;
        while (m < N_MAP && strcmp(argv[i] + 2, map[m].flag) != 0) m++;
        if (m == N_MAP) {   /* --config: read by the caller */
            i++;
            continue;
        }
        st = add(root, m, map[m].kind == FLAG ? NULL : argv[++i]);
    }
    if (!st && !(*json = cJSON_PrintUnformatted(root))) st = fr_fail(FR_ENOMEM, "out of memory");
    cJSON_Delete(root);
    return st;
}

fr_status fr_serve_flags_apply(int argc, char **argv, fr_serve_config *c)
{
    char *json = NULL;
    fr_status st = flags_to_json(argc, argv, &json);
    if (!st) st = fr_serve_config_parse(json, strlen(json), "command line", c);
    free(json);
    return st;
}
