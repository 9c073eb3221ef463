/* model_config: the Hugging Face config.json of a dense Qwen3 model.
 *
 * Only what the forward pass needs is kept. Anything that would change the
 * math without the engine knowing (another architecture, scaled RoPE, biased
 * attention, sliding windows, another activation) is refused with
 * FR_EUNSUPPORTED rather than silently ignored.
 */
#ifndef FR_MODEL_CONFIG_H
#define FR_MODEL_CONFIG_H

#include <stddef.h>

#include "base/fr_status.h"
#include "kvcache/calib_file.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    char architecture[64];   /* "Qwen3ForCausalLM" */
    int vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
        intermediate_size, max_position;
    float rms_norm_eps;
    double rope_theta;
    int tie_word_embeddings; /* 0 or 1; absent means 0 */
    int bos_id, pad_id;      /* -1 when absent or null */
    int n_eos;               /* 0..8 */
    int eos_ids[8];
} fr_model_config;

/* The shape of the model's calibration tables (kvcache/calib_file.h). */
static inline fr_calib_dims fr_model_calib_dims(const fr_model_config *c)
{
    return (fr_calib_dims){.layers = c->num_layers, .kv_heads = c->num_kv_heads, .head_dim = c->head_dim};
}

/* Parses json[0, len) (need not be NUL-terminated). `label` (usually the
 * path) starts every error message, followed by the offending key. On
 * failure *cfg is left zeroed. */
fr_status fr_model_config_parse(const char *json, size_t len, const char *label, fr_model_config *cfg);

/* Reads and parses the file at path. */
fr_status fr_model_config_load(const char *path, fr_model_config *cfg);

#ifdef __cplusplus
}
#endif

#endif
