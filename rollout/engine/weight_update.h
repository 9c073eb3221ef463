/* New weights for a running engine: the engine side of a trainer's weight
 * update (docs/protocol.md's update_weights), for every transport and every
 * rank. An update is staged, checked by the rules of weight_check.h (the
 * one place they live) as its buckets arrive, then switched in between
 * steps by fr_weight_commit, on one rank or on every rank together.
 *
 *     fr_weight_update *u;
 *     fr_weight_update_begin_for(session, version, &u);    // the stage (kept for the next update)
 *     fr_weight_update_declare(u, &begin, &why);            // the begin's tensors
 *     fr_weight_update_bucket(u, &bucket, &sum, &why);      // each bucket whose bytes are in host memory
 *     fr_weight_commit(session, u, version, world, &why);   // all ranks switch, or none
 *
 * A writer that moves the bytes itself (the NCCL receiver, weight_recv.h)
 * plans each bucket (fr_weight_update_plan), writes the values where
 * fr_weight_update_device_dst says, and reports it done
 * (fr_weight_update_done).
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
#include "comm/mpi_world.h"
#include "rollout/engine/session.h"
#include "rollout/engine/weight_check.h"
#include "rollout/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "F32", "BF16", "F16" (safetensors' names) -> dtype; FR_EINVAL otherwise. */
fr_status fr_weight_dtype_parse(const char *s, fr_dtype *out);

typedef struct fr_weight_update fr_weight_update;

/* Starts an update to `version` staged where session s keeps its weights
 * (device for CUDA, host for the CPU). The device stage takes a whole
 * model's BF16 bytes of device memory, on a tensor-parallel rank too. The
 * update is open (fr_weight_update_put) until a begin is declared. */
fr_status fr_weight_update_begin_for(const fr_session *s, uint64_t version, fr_weight_update **out);
/* The same, staged as a tensor-parallel rank's shard only (CUDA, tp > 1;
 * otherwise what begin_for makes): for a writer that cuts each rank's part
 * of the pieces itself (weights over NCCL, rollout/model/tp_piece.h), so no
 * rank holds a whole model's stage. Buckets of host bytes are refused;
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
/* Makes u (spent by a move commit, dropped, or in progress) a fresh open
 * update to `version`, keeping its staging memory: nothing counts as
 * received. A server keeps the spent update of one commit for the next, so
 * staging never allocates (and faults in) a model's worth of memory again. */
fr_status fr_weight_update_restart(fr_weight_update *u, uint64_t version);

/* A partial update (off after begin and restart): tensors of which no byte
 * arrives keep their serving values; a tensor that is sent must still
 * arrive whole, and at least one must. */
fr_status fr_weight_update_set_partial(fr_weight_update *u, int partial);
int fr_weight_update_is_partial(const fr_weight_update *u);
/* 1 when the stage is in device memory. */
int fr_weight_update_on_device(const fr_weight_update *u);

/* Restarts u to b's version with b's tensors declared (the rules of
 * fr_weight_check_begin; partial as b says). */
fr_status fr_weight_update_declare(fr_weight_update *u, const fr_weight_begin *b, fr_weight_refusal *why);

/* A bucket whose pieces' bytes are in host memory (each piece's `bytes`):
 * checked (fr_weight_check_bucket; *checksum: the bytes' own, NULL when
 * the sender's was checked already), stored in the stage, each value
 * converted and checked as it is (non_finite names the element), and
 * recorded. Any refusal fails the update. */
fr_status fr_weight_update_bucket(fr_weight_update *u, fr_weight_bucket *b, const uint64_t *checksum,
                                  fr_weight_refusal *why);

/* For writers that fill a device stage themselves (the NCCL receiver):
 * plan checks bucket b before its bytes arrive; once they are written and
 * checked on the device, done records it (its checksum, and the first bad
 * value: bad_piece -1 when none; fr_weight_check_done). fail records a
 * failure of the writer's own (the update takes nothing more). */
fr_status fr_weight_update_plan(fr_weight_update *u, fr_weight_bucket *b, fr_weight_refusal *why);
fr_status fr_weight_update_done(fr_weight_update *u, const fr_weight_bucket *b, const uint64_t *checksum,
                                int bad_piece, uint64_t bad_element, fr_weight_refusal *why);
fr_status fr_weight_update_fail(fr_weight_update *u, fr_weight_refusal r, fr_status st, fr_weight_refusal *why);
/* Where model tensor i's BF16 values start in a device stage (the rank's
 * part of it in a shard stage); NULL for a host stage or a spent update. */
uint16_t *fr_weight_update_device_dst(fr_weight_update *u, int i);

/* Part of tensor `name`, for an open update (tools, tests): its full shape
 * (ndim, shape) and dtype, and n_bytes bytes starting at byte `offset` of
 * the tensor's row-major data, checked by the same rules as a bucket's
 * piece (FR_EINVAL, naming the tensor) and stored, each value converted
 * and checked on the way (FR_EFORMAT, naming the element). On failure the
 * staged tensor is as before the call and the update stays usable. */
fr_status fr_weight_update_put(fr_weight_update *u, const char *name, fr_dtype dtype, const int64_t *shape,
                               int ndim, uint64_t offset, const void *bytes, size_t n_bytes);

/* Whether the update can commit (fr_weight_check_ready). */
fr_status fr_weight_update_ready(const fr_weight_update *u, fr_weight_refusal *why);
/* Bucket bytes received and stored so far. */
uint64_t fr_weight_update_bytes(const fr_weight_update *u);

/* The model's tensors: how many, the index of `name` (-1 when none), and
 * tensor i's name and shape (for tools that list them). */
int fr_weight_update_tensor_count(const fr_weight_update *u);
int fr_weight_update_find(const fr_weight_update *u, const char *name);
fr_status fr_weight_update_tensor(const fr_weight_update *u, int i, const char **name, int *ndim,
                                  int64_t shape[2]);

/* A host stage's model (complete or not; NULL for a device stage):
 * read-only access for tests. */
const fr_model *fr_weight_update_model(const fr_weight_update *u);

/* Switches the session to the staged weights: checks the update is ready
 * and of the session's model shape, then makes the staged tensors the
 * serving ones (a partial update: only those sent). The session must be
 * between steps, which makes the switch atomic for the tokens drawn. CUDA:
 * device-to-device copies into the serving weights in place, so captured
 * decode graphs stay valid; a tensor-parallel rank takes its part of each
 * tensor. CPU: host copies; a tensor-parallel rank cuts its shard again. A
 * stage must belong to the session's backend (fr_weight_update_begin_for).
 * On a check failure nothing changed; the update stays usable either way
 * and is freed by the caller. A failed device copy leaves the device
 * weights undefined and says so. */
fr_status fr_session_commit_weights(fr_session *s, const fr_weight_update *u);

/* The same switch, moving the staged weights instead of copying them where
 * the backend allows (the CPU backend, every tensor sent: the session's
 * model and the stage exchange their blocks, so the switch costs no copy;
 * CUDA copies as above). Either way the update is spent afterwards: put,
 * ready and commit refuse it; restart or free it. On a failure before the
 * switch nothing changed and u stays usable. */
fr_status fr_session_commit_weights_move(fr_session *s, fr_weight_update *u);

/* What fr_weight_commit did. */
typedef enum {
    FR_WEIGHTS_SWITCHED = 0, /* every rank serves `version` now */
    FR_WEIGHTS_KEPT,         /* no rank switched: the old version serves (*why, fr_last_error say why) */
    FR_WEIGHTS_SPLIT,        /* switched on some ranks only: the engines no longer agree and must stop */
    FR_WEIGHTS_NO_VOTE       /* the ranks could not vote (MPI failed): the job cannot go on */
} fr_weight_switch;

/* The one commit of a weight update, for every transport: u (NULL when
 * this rank staged nothing) must be the update to `version` and ready;
 * with a world w of several ranks, every rank calls this in the same turn
 * and all vote, then all switch between the same two steps and confirm, so
 * all serve the new version or none does. *why: this rank's refusal
 * (missing_tensor, ...), or update_failed when another rank voted no or
 * the switch failed. u is spent after FR_WEIGHTS_SWITCHED (keep it for
 * fr_weight_update_restart). */
fr_weight_switch fr_weight_commit(fr_session *s, fr_weight_update *u, uint64_t version, const fr_mpi_world *w,
                                  fr_weight_refusal *why);

#ifdef __cplusplus
}
#endif

#endif
