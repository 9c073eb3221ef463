/* Where a weight update's values wait until the commit (weight_update.h):
 * one interface, two implementations. The host stage
 * (weight_stage_host.c) holds a float32 copy of the model, the CPU
 * backend's own format, and commits by exchanging blocks or copying
 * tensors. The device stage (weight_stage_cuda.c) holds a BF16 copy of the
 * whole model in device memory, filled from the sender's bytes without a
 * float32 host copy, and commits with device-to-device copies into the
 * serving weights (a tensor-parallel rank: its part of each tensor).
 *
 * weight_update.c owns the bookkeeping (names, shapes, which bytes came);
 * a stage only stores values and switches them in. Tensors are numbered in
 * the order of rollout/model/tensor_table.h. Internal to rollout/engine. */
#ifndef FR_WEIGHT_STAGE_H
#define FR_WEIGHT_STAGE_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/fr_status.h"
#include "rollout/engine/session.h"

typedef struct fr_weight_stage fr_weight_stage;

typedef struct {
    /* Stores n values of dtype (little-endian bytes) as elements [first,
     * first + n) of tensor i, checking each: FR_EFORMAT with *bad (the
     * index among the n) at the first NaN or infinity, before or after
     * conversion. Elements of the range may have been written either way. */
    fr_status (*put)(fr_weight_stage *st, int i, fr_dtype dtype, size_t first, const void *bytes, size_t n,
                     size_t *bad);
    /* Makes tensors with touched[i] set the session's weights, between
     * steps. all: every tensor is touched; move: the stage may hand its
     * memory to the session (it holds something else afterwards). */
    fr_status (*commit)(fr_weight_stage *st, fr_session *s, const unsigned char *touched, int all, int move);
    /* Ready for a new update after a commit or a drop. */
    fr_status (*restart)(fr_weight_stage *st);
    void (*destroy)(fr_weight_stage *st);
} fr_weight_stage_ops;

struct fr_weight_stage {
    const fr_weight_stage_ops *ops;
    int on_device;
    int shard;                 /* device stage of one tensor-parallel rank's shard only */
    uint16_t **dev_dst;        /* device stage: where tensor i's BF16 values start */
    const fr_model *host;      /* host stage: the staged float32 model */
};

fr_status fr_weight_stage_host_new(const fr_model_config *cfg, fr_weight_stage **out);
/* The device stage for session s (CUDA backend): a whole-model BF16 buffer
 * of s's model and the table of s's serving weights to commit into. Built
 * only with CUDA; FR_EUNSUPPORTED otherwise. */
fr_status fr_weight_stage_device_new(const fr_session *s, fr_weight_stage **out);
/* The device stage of a tensor-parallel rank's own shard (s's serving
 * weights' layout): dev_dst[i] is where the rank's part of tensor i starts
 * (rollout/model/tp_piece.h). Filled by a writer that cuts the parts
 * itself (the NCCL receiver): put refuses whole-tensor ranges. The commit
 * copies part to part. Built only with CUDA. */
fr_status fr_weight_stage_device_shard_new(const fr_session *s, fr_weight_stage **out);

#endif
