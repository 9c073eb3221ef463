/* New weights for a running engine, received tensor by tensor (in pieces,
 * in any order), checked, then switched in between steps: the engine side of
 * a trainer's weight update (docs/protocol.md's update_weights), for every
 * transport and every rank.
 *
 *     fr_weight_update *u;
 *     fr_weight_update_begin_for(session, version, &u);
 *     fr_weight_update_put(u, "model.layers.0.self_attn.q_proj.weight", FR_DTYPE_BF16, shape, 2,
 *                          offset, bytes, n_bytes);        // as often as needed
 *     fr_session_commit_weights_move(session, u);          // or fr_weight_update_free: nothing changed
 *
 * The values wait in a stage (weight_stage.h) where the session keeps its
 * weights: for the CUDA backend a BF16 copy of the model in device memory,
 * filled from the sender's bytes with no float32 host copy; for the CPU
 * backend a float32 copy in host memory. A failed or abandoned update leaves
 * the serving weights untouched. Names and shapes are the Hugging Face ones
 * (rollout/model/tensor_table.h: model.embed_tokens.weight,
 * model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
 * self_attn.{q,k}_norm, post_attention_layernorm,
 * mlp.{gate,up,down}_proj}.weight, model.norm.weight, lm_head.weight unless
 * the embeddings are tied). Every value must be finite, and stay finite in
 * BF16 on the device. */
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

/* Starts an update to `version` staged where session s keeps its weights
 * (device for CUDA, host for the CPU). The device stage takes a whole
 * model's BF16 bytes of device memory, on a tensor-parallel rank too. */
fr_status fr_weight_update_begin_for(const fr_session *s, uint64_t version, fr_weight_update **out);
/* The same, staged as a tensor-parallel rank's shard only (CUDA, tp > 1;
 * otherwise what begin_for makes): for a writer that cuts each rank's part
 * of the pieces itself (weights over NCCL, rollout/model/tp_piece.h), so no
 * rank holds a whole model's stage. put refuses such a stage;
 * fr_weight_update_device_dst gives where the rank's part of a tensor
 * starts. */
fr_status fr_weight_update_begin_shard_for(const fr_session *s, uint64_t version, fr_weight_update **out);
/* 1 when u's stage holds one rank's shard only. */
int fr_weight_update_is_shard(const fr_weight_update *u);
/* Starts an update of a model of config cfg to `version`, staged on the
 * host (float32): for CPU sessions and for tools that list the tensors. */
fr_status fr_weight_update_begin(const fr_model_config *cfg, uint64_t version, fr_weight_update **out);
void fr_weight_update_free(fr_weight_update **u);
uint64_t fr_weight_update_version(const fr_weight_update *u);
/* Makes u (spent by a move commit, dropped, or in progress) a fresh update
 * to `version`, keeping its staging memory: nothing counts as received. A
 * server keeps the spent update of one commit for the next, so staging
 * never allocates (and faults in) a model's worth of memory again. */
fr_status fr_weight_update_restart(fr_weight_update *u, uint64_t version);

/* A partial update (off after begin and restart): tensors of which no byte
 * arrives keep their serving values; a tensor that is sent must still
 * arrive whole, and at least one must. */
fr_status fr_weight_update_set_partial(fr_weight_update *u, int partial);
int fr_weight_update_is_partial(const fr_weight_update *u);
/* 1 when the stage is in device memory. */
int fr_weight_update_on_device(const fr_weight_update *u);

/* Part of tensor `name`: its full shape (ndim, shape) and dtype, and n_bytes
 * bytes starting at byte `offset` of the tensor's row-major data (offset and
 * n_bytes multiples of the element size). Fails with a message naming the
 * tensor on an unknown name, a shape other than the model's, a range past
 * the tensor's end or a range that overlaps bytes already received
 * (FR_EINVAL), or a value that is NaN or infinite (FR_EFORMAT, naming the
 * element); on failure the staged tensor is as before the call. Values are
 * converted and checked straight into the stage. */
fr_status fr_weight_update_put(fr_weight_update *u, const char *name, fr_dtype dtype, const int64_t *shape,
                               int ndim, uint64_t offset, const void *bytes, size_t n_bytes);

/* For writers that fill a device stage themselves (the NCCL receiver):
 * the index of tensor `name` (-1 when the model has none), where its BF16
 * values start in the stage (NULL for a host stage or a spent update), and
 * the record that bytes [offset, offset + n_bytes) of it, sent in dtype,
 * were written and checked there (put's range checks, FR_EINVAL). */
int fr_weight_update_find(const fr_weight_update *u, const char *name);
uint16_t *fr_weight_update_device_dst(fr_weight_update *u, int i);
fr_status fr_weight_update_mark(fr_weight_update *u, int i, fr_dtype dtype, uint64_t offset, uint64_t n_bytes);

/* Whether every tensor has been received whole (a partial update: every
 * tensor sent, and one was); when not, FR_EINVAL naming the first missing
 * tensor and how much of it arrived. */
fr_status fr_weight_update_complete(const fr_weight_update *u);

/* Number of tensors an update expects, and the name and shape of tensor i
 * (for clients that want to list them). */
int fr_weight_update_tensor_count(const fr_weight_update *u);
fr_status fr_weight_update_tensor(const fr_weight_update *u, int i, const char **name, int *ndim,
                                  int64_t shape[2]);

/* A host stage's model (complete or not; NULL for a device stage):
 * read-only access for tests. */
const fr_model *fr_weight_update_model(const fr_weight_update *u);

/* Switches the session to the staged weights: checks completeness and the
 * model's shape, then makes the staged tensors the serving ones (a partial
 * update: only those sent). The session must be between steps, which makes
 * the switch atomic for the tokens drawn. CUDA: device-to-device copies
 * into the serving weights in place, so captured decode graphs stay valid;
 * a tensor-parallel rank takes its part of each tensor. CPU: host copies;
 * a tensor-parallel rank cuts its shard again. A stage must belong to the
 * session's backend (fr_weight_update_begin_for). On a check failure
 * nothing changed; the update stays usable either way and is freed by the
 * caller. A failed device copy leaves the device weights undefined and
 * says so. */
fr_status fr_session_commit_weights(fr_session *s, const fr_weight_update *u);

/* The same switch, moving the staged weights instead of copying them where
 * the backend allows (the CPU backend, every tensor sent: the session's
 * model and the stage exchange their blocks, so the switch costs no copy;
 * CUDA copies as above). Either way the update is spent afterwards: put,
 * complete and commit refuse it; restart or free it. On a failure before
 * the switch nothing changed and u stays usable. */
fr_status fr_session_commit_weights_move(fr_session *s, fr_weight_update *u);

#ifdef __cplusplus
}
#endif

#endif
