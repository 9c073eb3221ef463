/* The flags of `fp4rollout serve`: each serve option with a key fills the
 * configuration where its key does (fr_serve_key_store), so `serve --model
 * M --kv nvfp4 --port P` needs no file, and with --config the flags
 * override the file's values. */
#include "app/serve_flags.h"

#include "app/serve_keys.h"

fr_status fr_serve_flags_apply(const fr_cli_values *v, fr_serve_config *c)
{
    unsigned char given[FR_O_COUNT] = {0};
    fr_serve_config t = *c;
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *o = &fr_opts[r];
        if (!fr_opt_takes(o, FR_CMD_SERVE) || !o->key || !v->v[r].given) continue;
        fr_serve_key_store(o, &v->v[r], &t);
        given[r] = 1;
    }
    fr_status st = fr_serve_config_settle("command line", given, &t);
    if (!st) *c = t;
    return st;
}
