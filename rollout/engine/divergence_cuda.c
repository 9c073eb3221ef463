/* The device side of divergence monitoring (divergence_device.h) on the GPU:
 * the KL kernels of kl_cuda.h read the serving and shadow decodes' logits
 * where the CUDA runners left them. Built only with CUDA. */
#include "rollout/engine/divergence_device.h"

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/kl_cuda.h"
#include "rollout/model/runner_cuda.h"

struct fr_shadow_dev {
    int cap, vocab;
    /* rows 0, 1, ... of the shadow's decode, the served rows and chosen
     * tokens, the results */
    int *d_ref_rows, *d_served_rows, *d_chosen;
    fr_kl_result *d_out;
    int *carried_rows;     /* [cap]: the shadow's rows in a serving decode that carried it */
    /* The carried step's measurement, enqueued behind the decode on the
     * serving stream so the decode's own wait covers it: the KL kernels'
     * workspace, the tokens they used, and pinned host copies of the row
     * lists sent and the results (pending rows of it, 0: none enqueued). */
    void *d_kl_ws;
    size_t kl_ws_bytes;
    float *d_host_rows;    /* [host_rows_cap][vocab]: rows sent from the host to be measured (made on use) */
    int host_rows_cap;
    int *d_used;
    int *h_ref_rows, *h_served_rows, *h_used;
    fr_kl_result *h_out;
    int pending;
    cudaEvent_t kl_done;
};

static fr_runner_cuda *gpu_of(const fr_session *s) { return fr_runner_cuda_of(s->runner); }

fr_status fr_shadow_dev_new(const fr_session *shadow, int cap, fr_shadow_dev **out)
{
    *out = NULL;
    if (!gpu_of(shadow)) return FR_OK;   /* a CPU shadow measures on the host */
    fr_shadow_dev *d = calloc(1, sizeof *d);
    if (d) d->carried_rows = malloc(sizeof *d->carried_rows * (size_t)cap);
    if (!d || !d->carried_rows) {
        free(d);
        return fr_fail(FR_ENOMEM, "shadow: out of memory");
    }
    d->cap = cap;
    d->vocab = shadow->model->cfg.vocab_size;
    *out = d;
    return FR_OK;
}

/* The device and pinned buffers, NULL again. */
static void free_buffers(fr_shadow_dev *d)
{
    cudaFree(d->d_ref_rows);
    cudaFree(d->d_served_rows);
    cudaFree(d->d_chosen);
    cudaFree(d->d_out);
    cudaFree(d->d_kl_ws);
    cudaFree(d->d_used);
    cudaFreeHost(d->h_ref_rows);
    cudaFreeHost(d->h_served_rows);
    cudaFreeHost(d->h_used);
    cudaFreeHost(d->h_out);
    d->d_ref_rows = d->d_served_rows = d->d_chosen = d->d_used = NULL;
    d->d_out = NULL;
    d->d_kl_ws = NULL;
    d->h_ref_rows = d->h_served_rows = d->h_used = NULL;
    d->h_out = NULL;
}

void fr_shadow_dev_destroy(fr_shadow_dev **pd)
{
    fr_shadow_dev *d = pd ? *pd : NULL;
    if (!d) return;
    if (d->pending && d->kl_done) cudaEventSynchronize(d->kl_done);   /* nothing in flight writes freed memory */
    free_buffers(d);
    cudaFree(d->d_host_rows);
    if (d->kl_done) cudaEventDestroy(d->kl_done);
    free(d->carried_rows);
    free(d);
    *pd = NULL;
}

/* The device and pinned buffers of the measurement, made on first use
 * (all or none). */
static fr_status device_buffers(fr_shadow_dev *d)
{
    if (d->d_ref_rows) return FR_OK;
    const size_t cap = (size_t)d->cap;
    d->kl_ws_bytes = fr_kl_topk_cuda_ws_bytes(d->cap, d->vocab, FR_KL_TOP_K);
    if (cudaMalloc((void **)&d->d_ref_rows, sizeof(int) * cap) != cudaSuccess ||
        cudaMalloc((void **)&d->d_served_rows, sizeof(int) * cap) != cudaSuccess ||
        cudaMalloc((void **)&d->d_chosen, sizeof(int) * cap) != cudaSuccess ||
        cudaMalloc((void **)&d->d_out, sizeof(fr_kl_result) * cap) != cudaSuccess ||
        cudaMalloc(&d->d_kl_ws, d->kl_ws_bytes) != cudaSuccess ||
        cudaMalloc((void **)&d->d_used, sizeof(int) * cap) != cudaSuccess ||
        cudaMallocHost((void **)&d->h_ref_rows, sizeof(int) * cap) != cudaSuccess ||
        cudaMallocHost((void **)&d->h_served_rows, sizeof(int) * cap) != cudaSuccess ||
        cudaMallocHost((void **)&d->h_used, sizeof(int) * cap) != cudaSuccess ||
        cudaMallocHost((void **)&d->h_out, sizeof(fr_kl_result) * cap) != cudaSuccess ||
        cudaEventCreateWithFlags(&d->kl_done, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        free_buffers(d);
        d->kl_done = NULL;
        return fr_fail(FR_ENOMEM, "shadow: cannot allocate %zu rows of measurement buffers", cap);
    }
    return FR_OK;
}

/* D_t of n rows: reference rows ref_rows[j] of ref against served rows
 * served_rows[j] of served (device logits of finished decodes; row lists on
 * the host), on the default stream, results to out (host). */
static fr_status measure_on_device(fr_shadow_dev *d, const float *ref, const int *ref_rows, const float *served,
                                   const int *served_rows, const int *chosen, int n, fr_kl_result *out)
{
    const int V = d->vocab;
    if (cudaMemcpy(d->d_ref_rows, ref_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(d->d_served_rows, served_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(d->d_chosen, chosen, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "shadow: %s", cudaGetErrorString(cudaGetLastError()));
    fr_status st = fr_kl_topk_cuda_split(ref, d->d_ref_rows, served, d->d_served_rows, d->d_chosen, 0, n, V,
                                         FR_KL_TOP_K, d->d_kl_ws, d->kl_ws_bytes, d->d_out, NULL, 0);
    if (st) return st;
    if (cudaMemcpy(out, d->d_out, sizeof(fr_kl_result) * (size_t)n, cudaMemcpyDeviceToHost) != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "shadow: the divergence kernel failed: %s", cudaGetErrorString(cudaGetLastError()));
    return FR_OK;
}

fr_status fr_shadow_dev_decodes(fr_shadow_dev *d, const fr_session *shadow, const fr_session *served,
                                const int *ref_rows, const int *served_rows, const int *chosen, int n,
                                fr_kl_result *out)
{
    fr_status st = device_buffers(d);
    if (st) return st;
    return measure_on_device(d, fr_runner_cuda_decode_logits(gpu_of(shadow)), ref_rows,
                             fr_runner_cuda_decode_logits(gpu_of(served)), served_rows, chosen, n, out);
}

/* Enqueues the carried step's measurement behind its decode on the serving
 * stream: shadow rows first.. against served_rows, each with the token the
 * decode sampled for its served row, results to the pinned h_out. Returns
 * whether it was enqueued (when not, fr_shadow_dev_carried measures the
 * slow way). */
static int enqueue_carried_kl(fr_shadow_dev *d, const fr_session *served, const int *served_rows, int n)
{
    if (!served_rows || device_buffers(d)) return 0;
    for (int j = 0; j < n; j++) {
        if (served_rows[j] < 0) return 0;
        d->h_served_rows[j] = served_rows[j];
    }
    fr_runner_cuda *g = gpu_of(served);
    const int first = fr_runner_cuda_rider_first_row(g);
    for (int j = 0; j < n; j++) d->h_ref_rows[j] = first + j;
    const cudaStream_t stream = fr_runner_cuda_stream(g);
    const float *logits = fr_runner_cuda_decode_logits(g);
    const int V = d->vocab;
    if (cudaMemcpyAsync(d->d_ref_rows, d->h_ref_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, stream) ||
        cudaMemcpyAsync(d->d_served_rows, d->h_served_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice,
                        stream) ||
        fr_kl_topk_cuda_split(logits, d->d_ref_rows, logits, d->d_served_rows, fr_runner_cuda_decode_tokens(g), 1, n,
                              V, FR_KL_TOP_K, d->d_kl_ws, d->kl_ws_bytes, d->d_out, d->d_used, stream) ||
        cudaMemcpyAsync(d->h_out, d->d_out, sizeof(fr_kl_result) * (size_t)n, cudaMemcpyDeviceToHost, stream) ||
        cudaMemcpyAsync(d->h_used, d->d_used, sizeof(int) * (size_t)n, cudaMemcpyDeviceToHost, stream) ||
        cudaEventRecord(d->kl_done, stream)) {
        cudaGetLastError();
        /* Whatever was enqueued finishes before the host reads or reuses a buffer. */
        cudaStreamSynchronize(stream);
        cudaGetLastError();
        return 0;
    }
    return 1;
}

void fr_shadow_dev_carried_launched(fr_shadow_dev *d, const fr_session *served, const int *served_rows, int n)
{
    d->pending = 0;
    if (served_rows && enqueue_carried_kl(d, served, served_rows, n)) d->pending = n;
}

fr_status fr_shadow_dev_carried(fr_shadow_dev *d, const fr_session *served, const int *served_rows,
                                const int *chosen, int n, fr_kl_result *out)
{
    const int pending = d->pending;
    d->pending = 0;
    if (pending == n && cudaEventSynchronize(d->kl_done) == cudaSuccess) {
        /* Measured behind the decode: valid when it measured these rows with
         * the tokens the caller names (the decode's own draws). */
        int same = 1;
        for (int j = 0; j < n && same; j++) same = d->h_served_rows[j] == served_rows[j] && d->h_used[j] == chosen[j];
        if (same) {
            memcpy(out, d->h_out, sizeof(fr_kl_result) * (size_t)n);
            return FR_OK;
        }
    }
    cudaGetLastError();
    fr_status st = device_buffers(d);
    if (st) return st;
    /* The shadow's logits are the serving decode's rows after its own. */
    fr_runner_cuda *g = gpu_of(served);
    const int first = fr_runner_cuda_rider_first_row(g);
    for (int j = 0; j < n; j++) d->carried_rows[j] = first + j;
    const float *logits = fr_runner_cuda_decode_logits(g);
    return measure_on_device(d, logits, d->carried_rows, logits, served_rows, chosen, n, out);
}

/* Index of row in rows[0..*n), added when missing. */
static int row_index(const float **rows, int *n, const float *row)
{
    for (int i = 0; i < *n; i++)
        if (rows[i] == row) return i;
    rows[*n] = row;
    return (*n)++;
}

/* Room on the device for n rows sent from the host. */
static fr_status host_rows_room(fr_shadow_dev *d, int n)
{
    if (n <= d->host_rows_cap) return FR_OK;
    cudaFree(d->d_host_rows);
    d->host_rows_cap = 0;
    if (cudaMalloc((void **)&d->d_host_rows, sizeof(float) * (size_t)d->vocab * (size_t)n) != cudaSuccess) {
        cudaGetLastError();
        d->d_host_rows = NULL;
        return fr_fail(FR_ENOMEM, "shadow: cannot allocate %d rows of logits on the device", n);
    }
    d->host_rows_cap = n;
    return FR_OK;
}

fr_status fr_shadow_dev_rows(fr_shadow_dev *d, const fr_session *shadow, const float *const *ref,
                             const float *const *served, const int *chosen, int n, fr_kl_result *out)
{
    fr_status st = device_buffers(d);
    if (st) return st;
    if (d->pending) {   /* a carried measurement never read back: done with its buffers first */
        cudaEventSynchronize(d->kl_done);
        d->pending = 0;
    }
    const float **rows = malloc(sizeof *rows * 2 * (size_t)n);
    if (!rows) return fr_fail(FR_ENOMEM, "shadow: out of memory");
    int n_rows = 0;
    for (int j = 0; j < n; j++) {
        d->h_ref_rows[j] = row_index(rows, &n_rows, ref[j]);
        d->h_served_rows[j] = row_index(rows, &n_rows, served[j]);
        d->h_used[j] = chosen[j];
    }
    const int V = d->vocab;
    const size_t row = sizeof(float) * (size_t)V;
    if ((st = host_rows_room(d, n_rows))) {
        free(rows);
        return st;
    }
    const cudaStream_t stream = fr_runner_cuda_stream(gpu_of(shadow));
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < n_rows && e == cudaSuccess; i++)
        e = cudaMemcpyAsync(d->d_host_rows + (size_t)i * V, rows[i], row, cudaMemcpyHostToDevice, stream);
    free(rows);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(d->d_ref_rows, d->h_ref_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(d->d_served_rows, d->h_served_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice,
                            stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(d->d_chosen, d->h_used, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess)
        st = fr_kl_topk_cuda_split(d->d_host_rows, d->d_ref_rows, d->d_host_rows, d->d_served_rows, d->d_chosen, 0, n,
                                   V, FR_KL_TOP_K, d->d_kl_ws, d->kl_ws_bytes, d->d_out, NULL, stream);
    if (e == cudaSuccess && !st)
        e = cudaMemcpyAsync(d->h_out, d->d_out, sizeof(fr_kl_result) * (size_t)n, cudaMemcpyDeviceToHost, stream);
    cudaError_t w = cudaStreamSynchronize(stream);   /* also after a failure: the buffers are free after */
    if (st) return st;
    if (e != cudaSuccess || w != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "shadow: measuring rows from the host failed: %s",
                       cudaGetErrorString(e != cudaSuccess ? e : w));
    memcpy(out, d->h_out, sizeof(fr_kl_result) * (size_t)n);
    return FR_OK;
}
