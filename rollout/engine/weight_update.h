/* New weights for a running engine, received tensor by tensor (in pieces,
 * in any order), checked, then switched in between steps: the engine side of
 * a trainer's weight update (docs/protocol.md's update_weights).
 *
 *     fr_weight_update *u;
 *     fr_weight_update_begin(&session->model->cfg, version, &u);
 *     fr_weight_update_put(u, "model.layers.0.self_attn.q_proj.weight", FR_DTYPE_BF16, shape, 2,
 *                          offset, bytes, n_bytes);        // as often as needed
 *     fr_session_commit_weights(session, u);               // or fr_weight_update_free: nothing changed
 *
 * Staging is a whole float32 copy of the model in host memory (the model's
 * own layout, rollout/model/model.h), so a failed or abandoned update leaves the
 * serving weights untouched. Names and shapes are the Hugging Face ones
 * (model.embed_tokens.weight, model.layers.N.{input_layernorm,
 * self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm,
 * mlp.{gate,up,down}_proj}.weight, model.norm.weight, lm_head.weight unless
 * the embeddings are tied). Every value must be finite. */
#ifndef FR_WEIGHT_UPDATE_H
#define FR_WEIGHT_UPDATE_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "rollout/model/model.h"
#include "rollout/engine/session.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "F32", "BF16", "F16" (safetensors' names) -> dtype; FR_EINVAL otherwise. */
fr_status fr_weight_dtype_parse(const char *s, fr_dtype *out);

typedef struct fr_weight_update fr_weight_update;

/* Starts an update of a model of config cfg to `version`. */
fr_status fr_weight_update_begin(const fr_model_config *cfg, uint64_t version, fr_weight_update **out);
void fr_weight_update_free(fr_weight_update **u);
uint64_t fr_weight_update_version(const fr_weight_update *u);
/* Makes u (spent by a move commit, dropped, or in progress) a fresh update
 * to `version`, keeping its staging memory: nothing counts as received. A
 * server keeps the spent update of one commit for the next, so staging
 * never allocates (and faults in) a model's worth of memory again. */
fr_status fr_weight_update_restart(fr_weight_update *u, uint64_t version);

/* Part of tensor `name`: its full shape (ndim, shape) and dtype, and n_bytes
 * bytes starting at byte `offset` of the tensor's row-major data (offset and
 * n_bytes multiples of the element size). Fails with a message naming the
 * tensor on an unknown name, a shape other than the model's, a range past
 * the tensor's end or a range that overlaps bytes already received
 * (FR_EINVAL), or a value that is NaN or infinite (FR_EFORMAT, naming the
 * element); on failure the staged tensor is as before the call. Values are
 * converted and checked in one pass straight into the staging copy. */
fr_status fr_weight_update_put(fr_weight_update *u, const char *name, fr_dtype dtype, const int64_t *shape,
                               int ndim, uint64_t offset, const void *bytes, size_t n_bytes);

/* Whether every tensor has been received whole; when not, FR_EINVAL naming
 * the first missing tensor and how much of it arrived. */
fr_status fr_weight_update_complete(const fr_weight_update *u);

/* Number of tensors an update expects, and the name and shape of tensor i
 * (for clients that want to list them). */
int fr_weight_update_tensor_count(const fr_weight_update *u);
fr_status fr_weight_update_tensor(const fr_weight_update *u, int i, const char **name, int *ndim,
                                  int64_t shape[2]);

/* The staged model (complete or not): read-only access for tests and for
 * the key-mean recalibration after a commit. */
const fr_model *fr_weight_update_model(const fr_weight_update *u);

/* Switches the session to the staged weights: checks completeness, then
 * copies them into the backend's weights (host block; device block in place,
 * so captured decode graphs stay valid; a tensor-parallel rank takes its
 * shard). The session must be between steps. On a check failure nothing
 * changed; the update stays usable either way and is freed by the caller.
 * A CUDA copy failure leaves the device weights undefined and says so. */
fr_status fr_session_commit_weights(fr_session *s, const fr_weight_update *u);

/* The same switch, moving the staged weights instead of copying them where
 * the backend allows (the CPU backend: the session's model and the staged
 * one exchange their blocks, so the switch costs no copy; CUDA copies to
 * the device as above). Either way the update is spent afterwards: it then
 * holds no new weights, and put, complete and commit refuse it; free it.
 * On a failure before the switch nothing changed and u stays usable. */
fr_status fr_session_commit_weights_move(fr_session *s, fr_weight_update *u);

#ifdef __cplusplus
}
#endif

#endif
