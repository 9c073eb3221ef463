/* The device stage of weight updates (weight_stage.h) in a build without
 * CUDA (nvcc absent): there is no device to stage on. Built only without
 * CUDA, in place of weight_stage_cuda.c. */
#include "rollout/engine/weight_stage.h"

fr_status fr_weight_stage_device_new(const fr_session *s, fr_weight_stage **out)
{
    (void)s;
    *out = NULL;
    return fr_fail(FR_EUNSUPPORTED, "weight update: device staging needs a build with CUDA");
}

fr_status fr_weight_stage_device_shard_new(const fr_session *s, fr_weight_stage **out)
{
    return fr_weight_stage_device_new(s, out);
}
