/* What the engine commands share: the engine options (the table's group
 * FR_OG_ENGINE) read into fr_engine_opts, the sampling options of
 * generate and rollout, and the start of their ranks. */
#include "app/cli.h"

#include <stdlib.h>
#include <string.h>

#include "base/seed.h"

void fr_cli_engine_opts_default(fr_engine_opts *o)
{
    fr_engine_opts_default(o);
    o->model = fr_cli_demo_model();
}

/* Where each engine option's value goes. */
static void engine_set(int row, const fr_opt_value *v, fr_engine_opts *o)
{
    switch (row) {
    case FR_O_MODEL: o->model = v->s; break;
    case FR_O_BACKEND: o->backend = (fr_backend)v->i; break;
    case FR_O_KV: o->kv = (fr_kv_dtype)v->i; break;
    case FR_O_FP4_COMPUTE: o->compute = (fr_fp4_compute)v->i; break;
    case FR_O_RECIPE: o->recipe = v->recipe; break;
    case FR_O_CALIB: o->calib = v->s; break;
    case FR_O_CHUNK: o->chunk = (int)v->i; break;
    case FR_O_TP: o->tp = (int)v->i; break;
    case FR_O_MAX_MODEL_LEN: o->max_model_len = (int)v->i; break;
    case FR_O_DETERMINISTIC: o->deterministic = (int)v->i; break;
    default: break;
    }
}

void fr_cli_engine_opts_get(const fr_cli_values *v, fr_engine_opts *o)
{
    fr_cli_engine_opts_default(o);
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *row = &fr_opts[r];
        if (row->group == FR_OG_ENGINE && fr_opt_takes(row, v->cmd) && (v->v[r].given || row->def))
            engine_set(r, &v->v[r], o);
    }
}

/* The values bench programs pass live as long as argv; a value read here
 * keeps no allocation (no engine option is a list). */
int fr_engine_opts_parse(const char *cmd, int argc, char **argv, int *i, fr_engine_opts *o)
{
    const char *a = argv[*i];
    if (strncmp(a, "--", 2) != 0) return 0;
    for (int r = 0; r < FR_O_COUNT; r++) {
        const fr_opt *row = &fr_opts[r];
        if (row->group != FR_OG_ENGINE || !row->name) continue;
        if (strcmp(a + 2, row->name) != 0 && !(row->alias && strcmp(a + 2, row->alias) == 0)) continue;
        fr_opt_value v = {0};
        const char *text = NULL;
        if (row->type != FR_OPT_FLAG && *i + 1 >= argc) {
            fprintf(stderr, "%s: %s needs a value\n", cmd, a);
            return -1;
        }
        if (row->type != FR_OPT_FLAG) text = argv[++*i];
        if (fr_opt_from_text(row, a, text, &v)) {
            fprintf(stderr, "%s: %s\n", cmd, fr_last_error());
            return -1;
        }
        engine_set(r, &v, o);
        fr_opt_value_clear(&v);
        return 1;
    }
    return 0;
}

int fr_cli_sampling_get(fr_cmd cmd, const fr_cli_values *v, fr_cli_sampling *o)
{
    memset(o, 0, sizeof *o);
    o->n_samples = fr_opt_int(v, FR_O_N);
    o->max_tokens = fr_opt_int(v, FR_O_MAX_TOKENS);
    o->json = fr_opt_int(v, FR_O_JSON);
    o->ignore_eos = fr_opt_int(v, FR_O_IGNORE_EOS);
    o->min_tokens = fr_opt_int(v, FR_O_MIN_TOKENS);
    o->logprobs = fr_opt_int(v, FR_O_LOGPROBS);
    o->prompt_logprobs = fr_opt_int(v, FR_O_PROMPT_LOGPROBS);
    o->return_routed_experts = fr_opt_int(v, FR_O_RETURN_ROUTES);
    o->first_sample = fr_opt_int(v, FR_O_FIRST_SAMPLE);
    const fr_opt_value *stop = fr_opt_val(v, FR_O_STOP_IDS);
    if (stop->given) {
        o->stop = stop->ids;
        o->n_stop = stop->n;
    }
    o->sp = (fr_sampling_params){.temperature = (float)fr_opt_num(v, FR_O_TEMPERATURE),
                                 .top_k = fr_opt_int(v, FR_O_TOP_K),
                                 .top_p = (float)fr_opt_num(v, FR_O_TOP_P)};
    if (fr_opt_int(v, FR_O_GREEDY) && o->sp.temperature > 0.0f)
        return fr_cli_usage_error(cmd, "--greedy contradicts --temperature");
    if (o->min_tokens > o->max_tokens)
        return fr_cli_usage_error(cmd, "--min-tokens %d exceeds --max-tokens %d", o->min_tokens, o->max_tokens);
    if (fr_opt_given(v, FR_O_SEED)) o->sp.seed = fr_opt_val(v, FR_O_SEED)->u;
    else if (fr_seed_from_os(&o->sp.seed)) return fr_cli_fail(cmd, 1);
    return 0;
}

fr_status fr_cli_default_stops(const fr_model_config *mc, fr_cli_sampling *o, int **owned)
{
    *owned = NULL;
    if (o->stop || o->ignore_eos || mc->n_eos <= 0) return FR_OK;
    *owned = malloc(sizeof(int) * (size_t)mc->n_eos);
    if (!*owned) return fr_fail(FR_ENOMEM, "out of memory");
    memcpy(*owned, mc->eos_ids, sizeof(int) * (size_t)mc->n_eos);
    o->stop = *owned;
    o->n_stop = mc->n_eos;
    return FR_OK;
}

int fr_cli_launch(fr_cmd cmd, int tp, fr_tp_launch *l)
{
    fr_status st = fr_tp_launch_open(tp, l);
    return st ? fr_cli_fail(cmd, st == FR_EINVAL ? 2 : 1) : 0;
}
