/* CURVE for `fp4rollout serve` from the environment and key files
 * (app/serve_curve.h). */
#include "app/serve_curve.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "app/cli.h"
#include "app/serve_keys.h"

/* Splits a list of keys (commas or white space between them) into v, the
 * keys copied into buf. */
static fr_status env_keys(const char *name, const char *text, char *buf, size_t cap, fr_opt_value *v)
{
    if (strlen(text) >= cap) return fr_fail(FR_EINVAL, "%s is too long for %d keys", name, FR_SERVE_MAX_CURVE_CLIENTS);
    snprintf(buf, cap, "%s", text);
    for (char *save = NULL, *k = strtok_r(buf, ", \t\n", &save); k; k = strtok_r(NULL, ", \t\n", &save)) {
        if (!fr_opt_z85_key(k))
            return fr_fail(FR_EINVAL, "%s: \"%.48s\" is not a CURVE public key of 40 Z85 characters "
                                      "(fp4rollout-client keygen makes one)", name, k);
        if (v->n == FR_SERVE_MAX_CURVE_CLIENTS)
            return fr_fail(FR_EINVAL, "%s: at most %d keys", name, FR_SERVE_MAX_CURVE_CLIENTS);
        if (fr_opt_add_file(v, k)) return FR_ENOMEM;
    }
    return FR_OK;
}

/* One variable into its row's value: 1 when it is set. */
static fr_status env_value(const char *name, int row, char *buf, size_t cap, fr_opt_value *v, int *set)
{
    const char *text = getenv(name);
    *set = text && *text;
    if (!*set) return FR_OK;
    const fr_opt *o = &fr_opts[row];
    if (o->type == FR_OPT_KEYS) return env_keys(name, text, buf, cap, v);
    if (o->type == FR_OPT_KEY && !fr_opt_z85_key(text))
        return fr_fail(FR_EINVAL, "%s is not a CURVE secret key of 40 Z85 characters (fp4rollout-client keygen makes "
                                  "one)", name);
    if (strlen(text) >= o->size) return fr_fail(FR_EINVAL, "%s is too long", name);
    v->s = text;
    v->has = 1;
    return FR_OK;
}

fr_status fr_serve_curve_env(fr_serve_config *c)
{
    static const struct {
        const char *name;
        int row;
    } vars[] = {
        {FR_ENV_CURVE_SECRET_KEY, FR_O_CURVE_SERVER_KEY},
        {FR_ENV_CURVE_SECRET_KEY_FILE, FR_O_CURVE_SERVER_KEY_FILE},
        {FR_ENV_CURVE_TRAINER_KEYS, FR_O_CURVE_TRAINER_KEYS},
        {FR_ENV_CURVE_CLIENT_KEYS, FR_O_CURVE_CLIENT_KEYS},
    };
    enum { N = sizeof vars / sizeof vars[0], CAP = FR_SERVE_MAX_CURVE_CLIENTS * 48 };
    fr_serve_config t = *c;
    fr_status st = FR_OK;
    for (int i = 0; i < N && !st; i++) {
        char *buf = malloc(CAP);
        fr_opt_value v = {0};
        int set = 0;
        st = buf ? env_value(vars[i].name, vars[i].row, buf, CAP, &v, &set) : fr_fail(FR_ENOMEM, "out of memory");
        if (!st && set) fr_serve_key_store(&fr_opts[vars[i].row], &v, &t);
        fr_opt_value_clear(&v);
        free(buf);
    }
    /* No checks of keys against each other here: the file and the flags may
     * add what completes these (a secret key for keys listed here, say),
     * and the last of them checks the whole. */
    if (!st && t.curve.server_secret_key[0] && t.curve.server_secret_key_file[0])
        st = fr_fail(FR_EINVAL, "give " FR_ENV_CURVE_SECRET_KEY " or " FR_ENV_CURVE_SECRET_KEY_FILE ", not both");
    if (!st) *c = t;
    return st;
}

/* The key in a key file's text: the text itself, trimmed, or keygen's JSON. */
static fr_status key_of_text(const char *path, char *text, char out[FR_SERVE_CURVE_KEY])
{
    char *p = text, *end = text + strlen(text);
    while (isspace((unsigned char)*p)) p++;
    while (end > p && isspace((unsigned char)end[-1])) *--end = '\0';
    const char *key = p;
    cJSON *root = NULL;
    if (!fr_opt_z85_key(p) && *p == '{') {   /* a bare key may begin with '{' too: Z85 has it */
        root = cJSON_Parse(p);
        const cJSON *s = root ? cJSON_GetObjectItemCaseSensitive(root, "secret") : NULL;
        key = cJSON_IsString(s) ? s->valuestring : "";
    }
    fr_status st = FR_OK;
    if (!fr_opt_z85_key(key))
        st = fr_fail(FR_EINVAL, "%s: holds no CURVE secret key: give the key (40 Z85 characters) or the JSON that "
                                "`fp4rollout-client keygen` prints", path);
    else
        snprintf(out, FR_SERVE_CURVE_KEY, "%s", key);
    cJSON_Delete(root);
    return st;
}

fr_status fr_serve_curve_key_file(fr_serve_config *c)
{
    const char *path = c->curve.server_secret_key_file;
    if (!path[0]) return FR_OK;
    FILE *f = fopen(path, "rb");
    if (!f) return fr_fail(FR_EIO, "cannot read the CURVE key file %s: %s", path, strerror(errno));
    char text[1024];
    size_t n = fread(text, 1, sizeof text - 1, f);
    const int err = ferror(f), more = !err && fgetc(f) != EOF;
    fclose(f);
    if (err) return fr_fail(FR_EIO, "cannot read the CURVE key file %s", path);
    if (more) return fr_fail(FR_EINVAL, "%s: larger than %zu bytes; not a CURVE key file", path, sizeof text - 1);
    text[n] = '\0';
    return key_of_text(path, text, c->curve.server_secret_key);
}

int fr_serve_curve_check_bind(fr_cmd cmd, const fr_serve_config *c)
{
    char ep[FR_SERVE_HOST_MAX + 32];
    snprintf(ep, sizeof ep, "tcp://%s:%d", c->coordinator.bind, c->coordinator.port);
    if (c->curve.server_secret_key[0] || fr_bridge_endpoint_is_loopback(ep)) return 0;
    return fr_cli_usage_error(
        cmd,
        "--bind %s (coordinator.bind) is not a loopback address and CURVE is off: without CURVE every client has "
        "the trainer role (weight updates, pause), so the server binds loopback addresses only. Turn CURVE on with "
        "key pairs:\n"
        "  fp4rollout-client keygen > server-key.json     # the server's pair\n"
        "  fp4rollout-client keygen > trainer-key.json    # one per trainer (its \"public\" goes to the server)\n"
        "  fp4rollout serve --bind %s --curve-secret-key-file server-key.json --trainer-keys TRAINER_PUBLIC_KEY\n"
        "(or " FR_ENV_CURVE_SECRET_KEY_FILE " / " FR_ENV_CURVE_SECRET_KEY " and " FR_ENV_CURVE_TRAINER_KEYS
        " in the environment, or the curve object of the configuration; the clients then pass the server's public "
        "key and their own pair: docs/protocol.md, \"Authentication\")",
        c->coordinator.bind, c->coordinator.bind);
}
