/* Weights over NCCL in a build without CUDA (rollout/engine/weight_recv.h):
 * no group can be joined, so there is never an update to receive. Built
 * only when nvcc is not (weight_recv_cuda.c is the receiver). */
#include "rollout/engine/weight_recv.h"

fr_status fr_weight_recv_new(const unsigned char unique_id[FR_WEIGHT_RECV_ID_BYTES], int nranks, int rank,
                             int timeout_ms, fr_weight_recv **out)
{
    (void)unique_id;
    (void)nranks;
    (void)rank;
    (void)timeout_ms;
    if (out) *out = NULL;
    return fr_fail(FR_EUNSUPPORTED, "weights over NCCL: this server was built without CUDA; weights travel over "
                                    "ZeroMQ only");
}

fr_status fr_weight_recv_set_shard(fr_weight_recv *r, const fr_model_config *cfg, int tp_rank, int tp_size)
{
    (void)r;
    (void)cfg;
    (void)tp_rank;
    (void)tp_size;
    return fr_fail(FR_EUNSUPPORTED, "weights over NCCL: built without CUDA");
}

void fr_weight_recv_destroy(fr_weight_recv **r)
{
    if (r) *r = NULL;
}

fr_weight_recv_event fr_weight_recv_poll(fr_weight_recv *r, int *bucket, fr_weight_refusal *why)
{
    (void)r;
    (void)bucket;
    if (why) *why = FR_WREF_NONE;
    return FR_WR_NOTHING;
}

int fr_weight_recv_joined(const fr_weight_recv *r)
{
    (void)r;
    return 0;
}

fr_status fr_weight_recv_wait_joined(fr_weight_recv *r)
{
    (void)r;
    return fr_fail(FR_EUNSUPPORTED, "weights over NCCL: built without CUDA");
}

int fr_weight_recv_busy(const fr_weight_recv *r)
{
    (void)r;
    return 0;
}

fr_status fr_weight_recv_begin(fr_weight_recv *r, fr_weight_update *u, uint64_t bucket_bytes, fr_weight_refusal *why)
{
    (void)r;
    (void)u;
    (void)bucket_bytes;
    if (why) *why = FR_WREF_NCCL_UNAVAILABLE;
    return fr_fail(FR_EUNSUPPORTED, "weights over NCCL: built without CUDA");
}

fr_status fr_weight_recv_bucket(fr_weight_recv *r, fr_weight_bucket *b, fr_weight_refusal *why)
{
    (void)r;
    (void)b;
    if (why) *why = FR_WREF_NCCL_UNAVAILABLE;
    return fr_fail(FR_EUNSUPPORTED, "weights over NCCL: built without CUDA");
}

void fr_weight_recv_finish(fr_weight_recv *r) { (void)r; }

fr_status fr_weight_recv_drop(fr_weight_recv *r)
{
    (void)r;
    return FR_OK;
}
