/* The device side of opening and closing a session (session.c): the
 * weights a CUDA runner reads and the NCCL group of a tensor-parallel GPU
 * engine. session_cuda.c builds them; in a build without CUDA,
 * session_nocuda.c answers that there is no device. Private to
 * rollout/engine/. */
#ifndef FR_SESSION_DEVICE_H
#define FR_SESSION_DEVICE_H

#include "rollout/engine/session.h"

/* o->model's weights on the device, this rank's shard with tensor
 * parallelism (s->gpu_weights; the engine's NCCL group first, in s->nccl,
 * since it picks the rank's GPU). Synthetic models are generated on the
 * device; checkpoints are loaded on the host, copied, and their host
 * weights freed. *m receives the model's config (its weights dropped). On
 * failure nothing is left made. */
fr_status fr_session_device_load(const fr_engine_opts *o, fr_session *s, fr_model **m);
/* The same from a model already loaded on the host (copied; m stays the
 * caller's). */
fr_status fr_session_device_adopt(const fr_engine_opts *o, fr_session *s, fr_model *m);
/* The device weights to host memory and back (fr_session_release_memory);
 * nothing without CUDA. */
fr_status fr_session_device_memory(fr_session *s, int release);
/* The current device's free and total memory (cudaMemGetInfo). */
fr_status fr_session_device_free_memory(size_t *free_bytes, size_t *total_bytes);
/* Frees s->gpu_weights and s->nccl (NULL-safe). */
void fr_session_device_release(fr_session *s);

#endif
