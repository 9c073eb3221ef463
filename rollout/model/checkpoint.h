/* checkpoint: a Hugging Face model folder (config.json plus safetensors).
 *
 * The weights are either one model.safetensors or shards named by the
 * weight_map of model.safetensors.index.json. Shards stay memory-mapped until
 * fr_checkpoint_close(), so the fr_st_tensor pointers handed out live as long as
 * the checkpoint does.
 */
#ifndef FR_CHECKPOINT_H
#define FR_CHECKPOINT_H

#include <stdint.h>

#include "base/fr_status.h"
#include "rollout/model/model_config.h"
#include "base/safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_checkpoint fr_checkpoint;

fr_status fr_checkpoint_open(const char *dir, fr_checkpoint **out);
const fr_model_config *fr_checkpoint_config(const fr_checkpoint *c);

/* NULL when absent. With an index, only tensors its weight_map names exist. */
const fr_st_tensor *fr_checkpoint_find(const fr_checkpoint *c, const char *name);

/* Loads tensor `name` into dst as float32 after checking that its shape is
 * exactly shape[0..ndim) and its dtype is F32, F16 or BF16. dst holds the
 * product of shape elements. Errors name the shard file and the tensor. */
fr_status fr_checkpoint_load_f32(const fr_checkpoint *c, const char *name, int ndim,
                                 const int64_t *shape, float *dst);

void fr_checkpoint_close(fr_checkpoint **c); /* sets *c = NULL; accepts NULL */

#ifdef __cplusplus
}
#endif

#endif
