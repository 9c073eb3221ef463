/* The device side of a session in a build without CUDA (nvcc absent):
 * nothing is ever made on a device, and asking says so. Built only without
 * CUDA, in place of session_cuda.c. */
#include "rollout/engine/session_device.h"

fr_status fr_session_device_load(const fr_engine_opts *o, fr_session *s, fr_model **m)
{
    (void)o, (void)s;
    *m = NULL;
    return fr_fail(FR_EUNSUPPORTED, "--backend cuda: this build has no CUDA support (nvcc was absent)");
}

fr_status fr_session_device_adopt(const fr_engine_opts *o, fr_session *s, fr_model *m)
{
    (void)o, (void)s, (void)m;
    return fr_fail(FR_EUNSUPPORTED, "--backend cuda: this build has no CUDA support (nvcc was absent)");
}

fr_status fr_session_device_memory(fr_session *s, int release)
{
    (void)s;
    (void)release;
    return FR_OK;   /* no device: the weights are the host's */
}

fr_status fr_session_device_free_memory(size_t *free_bytes, size_t *total_bytes)
{
    *free_bytes = *total_bytes = 0;
    return fr_fail(FR_EUNSUPPORTED, "kv_memory_fraction: this build has no CUDA support (nvcc was absent)");
}

void fr_session_device_release(fr_session *s) { (void)s; }
