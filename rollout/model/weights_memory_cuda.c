/* Device weights given back to the GPU and taken again (weights_cuda.h,
 * fr_weights_gpu_release): for a trainer that shares the GPU between
 * rollouts (the HTTP API's release_memory_occupation). The bytes wait in
 * host memory; the new allocation may lie elsewhere, so every tensor
 * pointer is moved by the same offset. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/model/weights_cuda.h"

/* A layer's tensors are device pointers and nothing else: rebasing walks
 * them as an array. */
_Static_assert(sizeof(fr_layer_weights_gpu) % sizeof(uint16_t *) == 0, "fr_layer_weights_gpu holds pointers only");

/* Addresses as integers: the old block is freed, so its pointers are
 * offsets now and nothing else. */
static void move_ptr(uint16_t **p, uintptr_t from, uintptr_t to)
{
    if (*p) *p = (uint16_t *)(to + ((uintptr_t)*p - from));
}

static void rebase_all(fr_weights_gpu *w, uintptr_t from, uintptr_t to)
{
    move_ptr(&w->embed, from, to);
    move_ptr(&w->final_norm, from, to);
    move_ptr(&w->lm_head, from, to);
    const size_t per = sizeof(fr_layer_weights_gpu) / sizeof(uint16_t *);
    for (int l = 0; l < w->cfg.num_layers; l++) {
        uint16_t *ptrs[sizeof(fr_layer_weights_gpu) / sizeof(uint16_t *)];
        memcpy(ptrs, &w->layers[l], sizeof ptrs);
        for (size_t i = 0; i < per; i++) move_ptr(&ptrs[i], from, to);
        memcpy(&w->layers[l], ptrs, sizeof ptrs);
    }
}

fr_status fr_weights_gpu_release(fr_weights_gpu *w)
{
    if (!w) return fr_fail(FR_EINVAL, "fr_weights_gpu_release: NULL weights");
    if (w->host_copy_ || !w->block_) return FR_OK;
    void *host = malloc(w->bytes ? w->bytes : 1);
    if (!host) return fr_fail(FR_ENOMEM, "GPU weights: no host memory for %.2f GB of weights", (double)w->bytes / 1e9);
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(host, w->block_, w->bytes, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        free(host);
        return fr_fail(FR_EIO, "GPU weights: copying them to the host failed: %s", cudaGetErrorString(e));
    }
    cudaFree(w->block_);
    w->host_copy_ = host;
    return FR_OK;
}

fr_status fr_weights_gpu_restore(fr_weights_gpu *w)
{
    if (!w) return fr_fail(FR_EINVAL, "fr_weights_gpu_restore: NULL weights");
    if (!w->host_copy_) return FR_OK;
    void *dev = NULL;
    cudaError_t e = cudaMalloc(&dev, w->bytes ? w->bytes : 1);
    if (e != cudaSuccess)
        return fr_fail(FR_ENOMEM, "GPU weights: cannot allocate %.2f GB on the device again (still in another "
                                  "process's use?): %s", (double)w->bytes / 1e9, cudaGetErrorString(e));
    e = cudaMemcpy(dev, w->host_copy_, w->bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        cudaFree(dev);
        return fr_fail(FR_EIO, "GPU weights: copying them back failed: %s", cudaGetErrorString(e));
    }
    rebase_all(w, (uintptr_t)w->block_, (uintptr_t)dev);
    w->block_ = dev;
    free(w->host_copy_);
    w->host_copy_ = NULL;
    return FR_OK;
}
