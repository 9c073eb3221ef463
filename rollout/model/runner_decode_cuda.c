/* The CUDA runner's decode steps (runner_cuda.h): batches padded to buckets
 * and replayed from CUDA graphs captured on first use, launched and waited
 * apart, carrying a rider's rows (the BF16-KV shadow) with its own launches
 * on a side stream beside an FP4/FP8 cache's attention. */
#include "rollout/model/runner_cuda_internal.h"

#include <string.h>

#include "attention/cuda_check.h"
#include "base/clock.h"

/* The smallest bucket (a power of two, capped at max_seqs) holding n rows. */
static int bucket_of(const fr_runner_cuda *r, int n, int *rows)
{
    int b = 0, size = 1;
    while (size < n) size *= 2, b++;
    *rows = size < r->max_seqs ? size : r->max_seqs;
    return b;
}

fr_status fr_runner_cuda_decode(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                int n_seqs, int *tokens, float *logprobs)
{
    return fr_runner_cuda_decode_keep(r, seqs, params, n_seqs, tokens, logprobs, NULL, 0, NULL);
}

/* Enqueues the decode of `rows` rows (and r->riding rows of rider rd, when
 * carrying one) by replaying its graph, capturing it on first use. A
 * carrying decode's graph is kept per pair of buckets and names the rider it
 * was captured with (its cache and buffers are in the graph). */
static fr_status run_decode(fr_runner_cuda *r, int rows, int b, int b2, const fr_runner_cuda *rd)
{
    if (!r->use_graphs) return rcuda_enqueue_decode(r, rows);
    cudaGraphExec_t *slot = rd ? &r->rgraphs[b][b2] : &r->graphs[b];
    const int fresh = *slot && (rd ? r->rgraph_rider[b][b2] == rd->id : r->graph_rows[b] == rows);
    if (fresh) {
        FR_CUDA_TRY(cudaGraphLaunch(*slot, r->stream));
        return FR_OK;
    }
    /* First use: run it directly (which also prepares the matrix-product
     * plans and kernel attributes a capture must not create), then capture
     * the same launches for the next steps. */
    const double t0 = fr_now_s();
    r->captures++;
    fr_status st = rcuda_enqueue_decode(r, rows);
    if (st) return st;
    FR_CUDA_TRY(cudaStreamSynchronize(r->stream));
    FR_CUDA_TRY(cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t g = NULL;
    fr_status cap = rcuda_enqueue_decode(r, rows);
    cudaError_t e = cudaStreamEndCapture(r->stream, &g);
    if (cap) st = cap;
    else if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "decode graph capture failed: %s", cudaGetErrorString(e));
    if (!st) {
        if (*slot) cudaGraphExecDestroy(*slot);
        *slot = NULL;
        if (cudaGraphInstantiate(slot, g, 0) != cudaSuccess) {
            *slot = NULL;
            st = fr_fail(FR_EINTERNAL, "decode graph instantiation failed: %s", cudaGetErrorString(cudaGetLastError()));
        } else if (rd) {
            r->rgraph_rider[b][b2] = rd->id;
        } else {
            r->graph_rows[b] = rows;
        }
    }
    if (g) cudaGraphDestroy(g);
    r->capture_s += fr_now_s() - t0;
    return st;
}

/* The rider's metadata, sent on its stream, then its token ids and
 * positions placed after our rows and its rows added to the logit rows, on
 * ours: what a carrying decode reads besides our own metadata. */
static fr_status upload_rider(fr_runner_cuda *r, int rows, fr_runner_cuda *rd, const fr_step_seq *rseqs, int n_r,
                              int r_rows)
{
    int Mr = 0, n_logits = 0;
    fr_status st = rcuda_admit(rd, rseqs, n_r, &Mr);
    if (!st) st = rcuda_upload_metadata(rd, rseqs, n_r, r_rows, Mr, &n_logits);
    if (st) return st;
    if (!r->rider_ready && cudaEventCreateWithFlags(&r->rider_ready, cudaEventDisableTiming) != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "decode: cannot create an event");
    FR_CUDA_TRY(cudaEventRecord(r->rider_ready, rd->stream));
    FR_CUDA_TRY(cudaStreamWaitEvent(r->stream, r->rider_ready, 0));
    FR_CUDA_TRY(cudaMemcpyAsync(r->ids + rows, rd->ids, sizeof(int) * (size_t)r_rows, cudaMemcpyDeviceToDevice,
                                r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->pos + rows, rd->pos, sizeof(int) * (size_t)r_rows, cudaMemcpyDeviceToDevice,
                                r->stream));
    for (int j = 0; j < r_rows; j++) r->h_logit_rows[rows + j] = rows + j;
    FR_CUDA_TRY(cudaMemcpyAsync(r->logit_rows + rows, r->h_logit_rows + rows, sizeof(int) * (size_t)r_rows,
                                cudaMemcpyHostToDevice, r->stream));
    return FR_OK;
}

/* The side stream and its events, made before the first carrying decode
 * (never inside a capture); without them the rider's launches stay on our
 * stream. */
static void side_stream(fr_runner_cuda *r)
{
    if (cudaStreamCreateWithFlags(&r->side, cudaStreamNonBlocking) == cudaSuccess &&
        cudaEventCreateWithFlags(&r->side_fork, cudaEventDisableTiming) == cudaSuccess &&
        cudaEventCreateWithFlags(&r->side_join, cudaEventDisableTiming) == cudaSuccess)
        return;
    cudaGetLastError();
    if (r->side_fork) cudaEventDestroy(r->side_fork);
    if (r->side) cudaStreamDestroy(r->side);
    r->side = NULL;
    r->side_fork = r->side_join = NULL;
}

static fr_status decode_launch(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params, int n_seqs,
                               fr_runner_cuda *rd, const fr_step_seq *rseqs, int n_r)
{
    const int V = r->vocab;
    if (r->launched) return fr_fail(FR_EINVAL, "decode: the last launch has not been waited for");
    for (int s = 0; s < n_seqs; s++) {
        if (seqs[s].n != 1) return fr_fail(FR_EINVAL, "decode: sequence %d has %d new tokens, not 1", seqs[s].seq, seqs[s].n);
        fr_status st = fr_sample_row_check(&params[s], V);
        if (st) return st;
    }
    if (r->logit_cap < n_seqs) return fr_fail(FR_EINTERNAL, "decode: logits buffer smaller than the batch");
    int M = 0, rows, n_logits, r_rows = 0, b2 = 0;
    if (rd) {
        int want = n_r;
        if (want < r->rider_min_rows) want = r->rider_min_rows < rd->max_seqs ? r->rider_min_rows : rd->max_seqs;
        b2 = bucket_of(rd, want, &r_rows);
        if (!r->use_graphs) r_rows = n_r;
    }
    int b = bucket_of(r, n_seqs, &rows);
    if (!r->use_graphs) rows = n_seqs;
    if (rd && (rows + r_rows > r->max_tokens || rows + r_rows > r->logit_cap))
        return fr_fail(FR_EINVAL, "decode: %d rows and %d of a rider exceed the step's %d", rows, r_rows,
                       r->max_tokens < r->logit_cap ? r->max_tokens : r->logit_cap);
    r->route_rows = 0;   /* until this decode has run */
    fr_status st = rcuda_admit(r, seqs, n_seqs, &M);
    if (st) return st;
    if ((st = rcuda_upload_metadata(r, seqs, n_seqs, rows, M, &n_logits))) return st;
    if (rd && (st = upload_rider(r, rows, rd, rseqs, n_r, r_rows))) return st;
    if (rd && r->quantized_kv && !r->side && !r->side_off) side_stream(r);
    r->riding = r_rows;
    r->rider = rd;
    memcpy(r->h_sample_rows, params, sizeof(fr_sample_row) * (size_t)n_seqs);
    for (int s = n_seqs; s < rows; s++)   /* padding rows: greedy, never read */
        r->h_sample_rows[s] = (fr_sample_row){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f};
    FR_CUDA_TRY(cudaMemcpyAsync(r->sample_rows, r->h_sample_rows, sizeof(fr_sample_row) * (size_t)rows,
                                cudaMemcpyHostToDevice, r->stream));
    st = run_decode(r, rows, b, b2, rd);
    r->riding = 0;
    if (st) {
        r->rider = NULL;
        return st;
    }
    FR_CUDA_TRY(cudaMemcpyAsync(r->h_tokens, r->tokens_out, sizeof(int) * (size_t)n_seqs, cudaMemcpyDeviceToHost,
                                r->stream));
    FR_CUDA_TRY(cudaMemcpyAsync(r->h_logprobs, r->logprobs_out, sizeof(float) * (size_t)n_seqs,
                                cudaMemcpyDeviceToHost, r->stream));
    r->launched = n_seqs;
    r->route_rows = n_seqs;
    r->rider_seqs = rd ? rseqs : NULL;
    r->rider_n = rd ? n_r : 0;
    r->rider_rows = r_rows;
    r->rider_row0 = rows;
    return FR_OK;
}

fr_status fr_runner_cuda_decode_launch(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                       int n_seqs)
{
    return decode_launch(r, seqs, params, n_seqs, NULL, NULL, 0);
}

fr_status fr_runner_cuda_decode_launch_carrying(fr_runner_cuda *r, const fr_step_seq *seqs,
                                                const fr_sample_row *params, int n_seqs, fr_runner_cuda *rider,
                                                const fr_step_seq *rider_seqs, int n_rider)
{
    if (!rider || rider == r || n_rider < 1 || !rider_seqs)
        return fr_fail(FR_EINVAL, "decode: a rider needs its own runner and at least one sequence");
    if (rider->w != r->w || rider->quantized_kv || r->nccl || !rider->mla != !r->mla)
        return fr_fail(FR_EUNSUPPORTED, "decode: a rider must share the weights, keep a BF16 cache, and run "
                                        "without tensor parallelism");
    if (rider->launched) return fr_fail(FR_EINVAL, "decode: the rider has a decode of its own in flight");
    return decode_launch(r, seqs, params, n_seqs, rider, rider_seqs, n_rider);
}


/* A decode's list of rows whose logits go to the host: rows of its batch. */
static fr_status check_keep(const int *keep, int n_keep, const float *kept_logits, int n_seqs)
{
    if (n_keep < 0 || n_keep > n_seqs || (n_keep && (!keep || !kept_logits)))
        return fr_fail(FR_EINVAL, "decode: bad list of rows whose logits to keep");
    for (int i = 0; i < n_keep; i++)
        if (keep[i] < 0 || keep[i] >= n_seqs)
            return fr_fail(FR_EINVAL, "decode: row %d to keep is outside the batch of %d", keep[i], n_seqs);
    return FR_OK;
}

fr_status fr_runner_cuda_decode_wait(fr_runner_cuda *r, const fr_step_seq *seqs, int n_seqs, int *tokens,
                                     float *logprobs, const int *keep, int n_keep, float *kept_logits)
{
    const int V = r->vocab;
    if (r->launched != n_seqs || n_seqs < 1)
        return fr_fail(FR_EINVAL, "decode: waiting for %d sequences, %d were launched", n_seqs, r->launched);
    r->launched = 0;
    fr_status st = check_keep(keep, n_keep, kept_logits, n_seqs);
    /* Only the rows asked for cross to the host: a full batch of logits is
     * tens of MB per step at a 152k vocabulary. */
    for (int i = 0; i < n_keep && !st; i++) {
        cudaError_t e = cudaMemcpyAsync(kept_logits + (size_t)i * V, r->logits + (size_t)keep[i] * V,
                                        sizeof(float) * (size_t)V, cudaMemcpyDeviceToHost, r->stream);
        if (e != cudaSuccess) st = fr_fail(FR_EINTERNAL, "decode: %s", cudaGetErrorString(e));
    }
    /* Waits for the stream; the tokens enter the bookkeeping even after a
     * bad keep list, since the device cache holds them now. */
    fr_status chk = fr_kv_store_gpu_check(r->store, r->stream);
    fr_runner_cuda *rd = r->rider;
    const fr_step_seq *rseqs = r->rider_seqs;
    const int n_r = r->rider_n;
    r->rider = NULL;
    r->rider_seqs = NULL;
    r->rider_n = 0;
    if (!chk && rd) chk = fr_kv_store_gpu_check(rd->store, r->stream);
    for (int s = 0; s < n_r && !chk; s++) chk = fr_kv_append(rd->book, rseqs[s].seq, 1, NULL, NULL, 0);
    if (chk) return chk;
    if (tokens && !st) memcpy(tokens, r->h_tokens, sizeof(int) * (size_t)n_seqs);
    if (logprobs && !st) memcpy(logprobs, r->h_logprobs, sizeof(float) * (size_t)n_seqs);
    for (int s = 0; s < n_seqs; s++) {
        fr_status a = fr_kv_append(r->book, seqs[s].seq, 1, NULL, NULL, 0);
        if (a && !st) st = a;
    }
    return st;
}

fr_status fr_runner_cuda_decode_keep(fr_runner_cuda *r, const fr_step_seq *seqs, const fr_sample_row *params,
                                     int n_seqs, int *tokens, float *logprobs, const int *keep, int n_keep,
                                     float *kept_logits)
{
    fr_status st = check_keep(keep, n_keep, kept_logits, n_seqs);   /* refused before anything runs */
    if (st || n_seqs == 0) return st;
    st = fr_runner_cuda_decode_launch(r, seqs, params, n_seqs);
    return st ? st : fr_runner_cuda_decode_wait(r, seqs, n_seqs, tokens, logprobs, keep, n_keep, kept_logits);
}

