/* The serve configuration (configs/README.md): its keys, types, ranges
 * and defaults are the option table's rows with a key (app/options.def);
 * this file walks a JSON text over them, strict about unknown and repeated
 * keys, then checks the values against each other. */
#include "app/serve_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "app/serve_keys.h"
#include "rollout/model/model.h"

void fr_serve_config_default(fr_serve_config *c)
{
    memset(c, 0, sizeof *c);
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        fr_opt_value v = {0};
        if (o->key && o->def && fr_opt_from_text(o, o->key, o->def, &v) == FR_OK) fr_serve_key_store(o, &v, c);
        fr_opt_value_clear(&v);
    }
    /* What the table's defaults, command-line values, cannot say: */
    snprintf(c->model, sizeof c->model, "synthetic:tiny");   /* the serve command puts the demo model first */
    c->metrics_port_default = 1;                              /* the default port gives way when taken */
    c->recalibration.context = -1;                            /* calibrate's own default */
}

void fr_serve_config_engine_opts(const fr_serve_config *c, fr_engine_opts *o)
{
    fr_engine_opts_default(o);
    o->model = c->model;
    o->backend = c->backend;
    o->kv = c->kv_dtype;
    o->compute = c->fp4_compute;
    o->recipe = c->recipe;
    o->calib = c->calib[0] ? c->calib : NULL;
    o->chunk = c->chunk;
    o->max_model_len = c->max_model_len;
    o->tp = c->tp;   /* the caller sets o->group (app/tp_launch.h) */
    o->deterministic = c->deterministic;
}

/* ---- the keys of one object ---------------------------------------------- */

/* A name at one level of the keys: a key's row, or an object (row -1). */
typedef struct {
    char name[48];
    int row;
} level_name;
enum { MAX_LEVEL = 64 };

/* The names under prefix ("" or "coordinator."), from the table's keys. */
static int level_names(const char *prefix, level_name *out)
{
    const size_t pl = strlen(prefix);
    int n = 0;
    for (int r = 0; r < FR_O_COUNT && n < MAX_LEVEL; r++) {
        const char *key = fr_opts[r].key;
        if (!key || strncmp(key, prefix, pl) != 0) continue;
        const char *rest = key + pl;
        const size_t len = strcspn(rest, ".");
        int seen = 0;
        for (int k = 0; k < n && !seen; k++) seen = strlen(out[k].name) == len && strncmp(out[k].name, rest, len) == 0;
        if (seen || len >= sizeof out[n].name) continue;
        memcpy(out[n].name, rest, len);
        out[n].name[len] = '\0';
        out[n++].row = rest[len] ? -1 : r;
    }
    return n;
}

/* Edit distance of two short strings ('-' and '_' count as equal), capped. */
static int distance(const char *a, const char *b)
{
    enum { MAX = 40 };
    size_t la = strlen(a), lb = strlen(b);
    if (la >= MAX || lb >= MAX) return MAX;
    int row[MAX + 1];
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            char ca = a[i - 1] == '-' ? '_' : a[i - 1], cb = b[j - 1] == '-' ? '_' : b[j - 1];
            int sub = diag + (ca != cb), del = row[j] + 1, ins = row[j - 1] + 1;
            diag = row[j];
            row[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
    }
    return row[lb];
}

/* The known name nearest to `key`, or NULL when none is near: the
 * shortest that `key` begins ("kv" for "kv_dtype"), else one within two
 * edits (one for keys of up to three letters). */
static const char *nearest(const char *key, const level_name *names, int n)
{
    const size_t len = strlen(key);
    const char *best = NULL;
    for (int i = 0; len >= 2 && i < n; i++)
        if (strncmp(key, names[i].name, len) == 0 && (!best || strlen(names[i].name) < strlen(best)))
            best = names[i].name;
    if (best) return best;
    int best_d = len >= 4 ? 3 : 2;
    for (int i = 0; i < n; i++) {
        int d = distance(key, names[i].name);
        if (d < best_d) {
            best_d = d;
            best = names[i].name;
        }
    }
    return best;
}

static int find_name(const char *key, const level_name *names, int n)
{
    for (int i = 0; i < n; i++)
        if (strcmp(key, names[i].name) == 0) return i;
    return -1;
}

/* Every member of obj must be a known name, given once. */
static fr_status check_keys(const char *label, const cJSON *obj, const char *prefix, const level_name *names, int n)
{
    for (const cJSON *it = obj->child; it; it = it->next) {
        if (find_name(it->string, names, n) < 0) {
            const char *guess = nearest(it->string, names, n);
            if (guess)
                return fr_fail(FR_EINVAL, "%s: unknown key \"%s%s\" (did you mean \"%s%s\"?)", label, prefix,
                               it->string, prefix, guess);
            return fr_fail(FR_EINVAL, "%s: unknown key \"%s%s\" (configs/README.md lists every key)", label, prefix,
                           it->string);
        }
        for (const cJSON *prev = obj->child; prev != it; prev = prev->next)
            if (strcmp(prev->string, it->string) == 0)
                return fr_fail(FR_EINVAL, "%s: key \"%s%s\" is given twice", label, prefix, it->string);
    }
    return FR_OK;
}

/* Reads obj's members into c: a key's value by its row, an object's
 * members by the same walk one level down. */
static fr_status read_object(const char *label, const cJSON *obj, const char *prefix, fr_serve_config *c,
                             unsigned char *given)
{
    level_name names[MAX_LEVEL];
    const int n = level_names(prefix, names);
    fr_status st = check_keys(label, obj, prefix, names, n);
    for (const cJSON *it = obj->child; it && !st; it = it->next) {
        char path[160];
        snprintf(path, sizeof path, "%s%s", prefix, it->string);
        const int row = names[find_name(it->string, names, n)].row;
        if (row < 0) {
            if (!cJSON_IsObject(it))
                return fr_fail(FR_EINVAL, "%s: %s: expected an object, got %s", label, path, fr_serve_json_type(it));
            strcat(path, ".");
            st = read_object(label, it, path, c, given);
            continue;
        }
        fr_opt_value v = {0};
        st = fr_serve_key_read(&fr_opts[row], it, label, path, &v);
        if (!st) fr_serve_key_store(&fr_opts[row], &v, c);
        fr_opt_value_clear(&v);
        given[row] = 1;
    }
    return st;
}

/* ---- values against each other ------------------------------------------- */

/* The curve and recalibration objects: what their keys need of each other. */
static fr_status check_objects(const char *label, const unsigned char *given, const fr_serve_config *c)
{
    if (strstr(c->coordinator.bind, "://"))
        return fr_fail(FR_EINVAL, "%s: coordinator.bind: give the host or interface only (e.g. \"127.0.0.1\" or "
                                  "\"*\"), not a URL", label);
    const int secret = c->curve.server_secret_key[0] != '\0' || c->curve.server_secret_key_file[0] != '\0';
    if (secret && c->curve.n_clients + c->curve.n_trainers == 0)
        return fr_fail(FR_EINVAL, "%s: curve: a server_secret_key needs at least one key in client_public_keys "
                                  "(only listed clients may connect) or trainer_public_keys", label);
    if (!secret && c->curve.n_trainers > 0)
        return fr_fail(FR_EINVAL, "%s: curve: trainer_public_keys needs a server_secret_key", label);
    if (!secret && c->curve.n_clients > 0)
        return fr_fail(FR_EINVAL, "%s: curve: client_public_keys needs a server_secret_key", label);
    const fr_serve_recal *r = &c->recalibration;
    const int on = r->kl_threshold > 0 || r->after_commit;
    int any = 0;
    for (int k = 0; k < FR_O_COUNT; k++)
        any |= given[k] && fr_opts[k].key && strncmp(fr_opts[k].key, "recalibration.", 14) == 0;
    if (on && r->n_texts == 0)
        return fr_fail(FR_EINVAL, "%s: recalibration: needs texts (the seed texts calibration runs on)", label);
    if (!on && any)
        return fr_fail(FR_EINVAL, "%s: recalibration: give kl_threshold (the mean KL in nats above which the key "
                                  "mean is recalibrated), after_commit true, or both", label);
    return FR_OK;
}

fr_status fr_serve_config_settle(const char *label, const unsigned char given[FR_O_COUNT], fr_serve_config *c)
{
    if (given[FR_O_METRICS_PORT]) c->metrics_port_default = 0;
    /* The secret key itself or a file of it: one text gives one of them,
     * and a later text's replaces an earlier one's. */
    char *key = c->curve.server_secret_key, *file = c->curve.server_secret_key_file;
    if (given[FR_O_CURVE_SERVER_KEY] && given[FR_O_CURVE_SERVER_KEY_FILE] && key[0] && file[0])
        return fr_fail(FR_EINVAL, "%s: curve: give server_secret_key or server_secret_key_file, not both", label);
    if (given[FR_O_CURVE_SERVER_KEY_FILE] && file[0]) key[0] = '\0';
    if (given[FR_O_CURVE_SERVER_KEY] && key[0]) file[0] = '\0';
    fr_status st = check_objects(label, given, c);
    if (st) return st;
    if (given[FR_O_KV_MEMORY_FRACTION] && given[FR_O_KV_BLOCKS] && c->kv_blocks > 0)
        return fr_fail(FR_EINVAL,
                       "%s: kv_blocks (%d) and kv_memory_fraction are alternatives: give one of them "
                       "(kv_blocks 0 means sized by kv_memory_fraction)",
                       label, c->kv_blocks);
    if (given[FR_O_KV_MEMORY_FRACTION] && c->backend == FR_BACKEND_CPU)
        return fr_fail(FR_EINVAL,
                       "%s: kv_memory_fraction sizes the KV cache in GPU memory; with backend \"cpu\" "
                       "give kv_blocks instead",
                       label);
    if ((c->recalibration.kl_threshold > 0 || c->recalibration.after_commit) && c->tp > 1)
        return fr_fail(FR_EINVAL, "%s: recalibration needs tp 1 (each engine one rank); tp is %d", label, c->tp);
    if (c->metrics_log[0] && c->metrics_port == 0)
        return fr_fail(FR_EINVAL, "%s: metrics_log records the history the metrics endpoint keeps: set "
                                  "metrics_port too (it is 0: off)",
                       label);
    const struct { const char *name; int port; } ports[] = {
        {"coordinator.port", c->coordinator.port},
        {"coordinator.weight_port", c->coordinator.weight_port},
        {"coordinator.engine_port", c->coordinator.engine_port},
        {"metrics_port", c->metrics_port_default ? 0 : c->metrics_port},   /* the default gives way */
        {"metrics_pub_port", c->metrics_pub_port},
    };
    const int n_ports = (int)(sizeof ports / sizeof ports[0]);
    for (int a = 0; a < n_ports; a++)
        for (int b = a + 1; b < n_ports; b++)
            if (ports[a].port != 0 && ports[a].port == ports[b].port)
                return fr_fail(FR_EINVAL, "%s: %s and %s are both %d: each socket needs its own port", label,
                               ports[a].name, ports[b].name, ports[a].port);
    return FR_OK;
}

/* ---- a text -------------------------------------------------------------- */

/* Line and column (from 1) of byte offset pos. */
static void line_col(const char *text, size_t pos, int *line, int *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < pos; i++) {
        if (text[i] == '\n') {
            (*line)++;
            *col = 1;
        } else {
            (*col)++;
        }
    }
}

/* The JSON text's one object, or an error at the place that is not. */
static fr_status parse_json(const char *text, size_t len, const char *label, cJSON **root)
{
    const char *end = NULL;
    int line, col;
    *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!*root) {
        size_t pos = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        line_col(text, pos, &line, &col);
        return fr_fail(FR_EFORMAT, "%s: not valid JSON (line %d, column %d)", label, line, col);
    }
    size_t pos = (size_t)(end - text);
    while (pos < len && (text[pos] == ' ' || text[pos] == '\t' || text[pos] == '\n' || text[pos] == '\r' ||
                         text[pos] == '\0'))
        pos++;
    if (pos < len) {
        line_col(text, pos, &line, &col);
        return fr_fail(FR_EFORMAT, "%s: unexpected text after the JSON object (line %d, column %d)", label, line,
                       col);
    }
    if (!cJSON_IsObject(*root))
        return fr_fail(FR_EFORMAT, "%s: the configuration must be a JSON object, got %s", label,
                       fr_serve_json_type(*root));
    return FR_OK;
}

fr_status fr_serve_config_parse(const char *text, size_t len, const char *label, fr_serve_config *c)
{
    if (!label) label = "(config)";
    if (!text || !c) return fr_fail(FR_EINVAL, "%s: no configuration text", label);
    cJSON *root = NULL;
    fr_status st = parse_json(text, len, label, &root);
    fr_serve_config t = *c;
    unsigned char given[FR_O_COUNT] = {0};
    if (!st) st = read_object(label, root, "", &t, given);
    if (!st) st = fr_serve_config_settle(label, given, &t);
    cJSON_Delete(root);
    if (!st) *c = t;
    return st;
}

/* Makes a relative path p relative to the folder dir (no change when dir
 * is NULL: the file is in the working directory). */
static fr_status rebase(char *p, size_t cap, const char *dir, const char *label, const char *key)
{
    if (!dir || !p[0] || p[0] == '/' || strncmp(p, FR_SYNTHETIC_PREFIX, strlen(FR_SYNTHETIC_PREFIX)) == 0)
        return FR_OK;
    char joined[FR_SERVE_PATH_MAX];
    const char *sep = dir[strlen(dir) - 1] == '/' ? "" : "/";
    int n = snprintf(joined, sizeof joined, "%s%s%s", dir, sep, p);
    if (n < 0 || (size_t)n >= cap || (size_t)n >= sizeof joined)
        return fr_fail(FR_EINVAL, "%s: %s: the path relative to the file's folder is too long", label, key);
    memcpy(p, joined, (size_t)n + 1);
    return FR_OK;
}

fr_status fr_serve_config_load(const char *path, fr_serve_config *c)
{
    if (!path || !c) return fr_fail(FR_EINVAL, "fr_serve_config_load: path or config is NULL");
    FILE *f = fopen(path, "rb");
    if (!f) return fr_fail(FR_EIO, "cannot read config file %s: %s", path, strerror(errno));
    enum { LIMIT = 1 << 20 };
    char *buf = malloc(LIMIT + 1);
    if (!buf) {
        fclose(f);
        return fr_fail(FR_ENOMEM, "%s: out of memory", path);
    }
    size_t n = fread(buf, 1, LIMIT + 1, f);
    int err = ferror(f);
    fclose(f);
    fr_status st = FR_OK;
    if (err) st = fr_fail(FR_EIO, "cannot read config file %s", path);
    else if (n > LIMIT) st = fr_fail(FR_EFORMAT, "%s: larger than %d bytes; not a configuration", path, LIMIT);
    fr_serve_config t = *c;
    if (!st) st = fr_serve_config_parse(buf, n, path, &t);
    free(buf);
    if (st) return st;
    /* The file's folder: "dir/x.json" -> "dir", "/x.json" -> "/", "x.json" -> none. */
    char dir[FR_SERVE_PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (slash) {
        size_t dl = slash == path ? 1 : (size_t)(slash - path);
        if (dl >= sizeof dir) return fr_fail(FR_EINVAL, "%s: path too long", path);
        memcpy(dir, path, dl);
        dir[dl] = '\0';
    }
    if ((st = rebase(t.model, sizeof t.model, slash ? dir : NULL, path, "model"))) return st;
    if ((st = rebase(t.calib, sizeof t.calib, slash ? dir : NULL, path, "calib"))) return st;
    if ((st = rebase(t.tokenizer, sizeof t.tokenizer, slash ? dir : NULL, path, "tokenizer"))) return st;
    for (int i = 0; i < t.recalibration.n_texts; i++)
        if ((st = rebase(t.recalibration.texts[i], sizeof t.recalibration.texts[i], slash ? dir : NULL, path,
                         "recalibration.texts")))
            return st;
    if ((st = rebase(t.recalibration.out_dir, sizeof t.recalibration.out_dir, slash ? dir : NULL, path,
                     "recalibration.out_dir")))
        return st;
    if ((st = rebase(t.metrics_log, sizeof t.metrics_log, slash ? dir : NULL, path, "metrics_log"))) return st;
    if ((st = rebase(t.curve.server_secret_key_file, sizeof t.curve.server_secret_key_file, slash ? dir : NULL, path,
                     "curve.server_secret_key_file")))
        return st;
    *c = t;
    return FR_OK;
}


/* Keys whose value is not written: the reader would refuse it back, or
 * it is a default that must stay one. */
static int omitted(int r, const fr_serve_config *c)
{
    const fr_serve_recal *rc = &c->recalibration;
    const int recal = rc->kl_threshold > 0 || rc->after_commit;
    switch (r) {
    case FR_O_KV_MEMORY_FRACTION: return c->kv_blocks != 0 || c->backend == FR_BACKEND_CPU;   /* GPU-only alternative */
    case FR_O_METRICS_PORT: return c->metrics_port_default;
    case FR_O_CURVE_SERVER_KEY:
    case FR_O_CURVE_SERVER_KEY_FILE:
    case FR_O_CURVE_CLIENT_KEYS:
    case FR_O_CURVE_TRAINER_KEYS: return !c->curve.server_secret_key[0] && !c->curve.server_secret_key_file[0];
    case FR_O_RECAL_KL_THRESHOLD: return !recal || rc->kl_threshold <= 0;
    case FR_O_RECAL_CONTEXT: return !recal || rc->context < 0;
    default: return !recal && strncmp(fr_opts[r].key, "recalibration.", 14) == 0;
    }
}

/* Adds item at the key's path, making the objects on the way. */
static int add_at(cJSON *root, const char *key, cJSON *item)
{
    cJSON *obj = root;
    const char *dot;
    while (obj && (dot = strchr(key, '.'))) {
        char name[48];
        snprintf(name, sizeof name, "%.*s", (int)(dot - key), key);
        cJSON *next = cJSON_GetObjectItemCaseSensitive(obj, name);
        obj = next ? next : cJSON_AddObjectToObject(obj, name);
        key = dot + 1;
    }
    if (!obj || !item) {
        cJSON_Delete(item);
        return 0;
    }
    cJSON_AddItemToObject(obj, key, item);
    return 1;
}

fr_status fr_serve_config_to_json(const fr_serve_config *c, char **json)
{
    if (!c || !json) return fr_fail(FR_EINVAL, "fr_serve_config_to_json: config or output is NULL");
    *json = NULL;
    cJSON *root = cJSON_CreateObject();
    int ok = root != NULL;
    for (int r = 0; ok && r < FR_O_COUNT; r++)
        if (fr_opts[r].key && !omitted(r, c)) ok = add_at(root, fr_opts[r].key, fr_serve_key_json(&fr_opts[r], c));
    char *text = ok ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!text) return fr_fail(FR_ENOMEM, "fr_serve_config_to_json: out of memory");
    *json = text;   /* cJSON's allocator is malloc unless changed: the caller frees with free() */
    return FR_OK;
}
