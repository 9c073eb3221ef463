#include "rollout/engine/divergence.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kv_cache.h"
#ifdef FR_HAVE_CUDA
#include <cuda_runtime.h>

#include "rollout/engine/kl_cuda.h"
#include "rollout/model/runner_cuda.h"
#endif

/* ---- summaries ---- */

void fr_div_summary_add(fr_div_summary *s, const fr_kl_result *r)
{
    s->n++;
    s->kl_sum += r->kl;
    if (s->n == 1 || r->kl > s->kl_max) s->kl_max = r->kl;
    s->top1_agree += r->top1_match != 0;
    s->logp_diff_sum += r->logp_diff;
}

double fr_div_summary_mean(const fr_div_summary *s) { return s->n ? s->kl_sum / (double)s->n : NAN; }

int fr_div_bucket_of(long position)
{
    static const long ends[FR_DIV_BUCKETS - 1] = {1024, 4096, 16384, 65536};
    int b = 0;
    while (b < FR_DIV_BUCKETS - 1 && position >= ends[b]) b++;
    return b;
}

const char *fr_div_bucket_name(int b)
{
    static const char *const names[FR_DIV_BUCKETS] = {"0-1K", "1K-4K", "4K-16K", "16K-64K", "64K+"};
    return b >= 0 && b < FR_DIV_BUCKETS ? names[b] : "?";
}

const fr_div_version *fr_div_aggregates_find(const fr_div_aggregates *a, uint64_t version)
{
    for (int i = 0; i < FR_DIV_VERSIONS; i++)
        if (a->v[i].used && a->v[i].version == version) return &a->v[i];
    return NULL;
}

/* The entry of `version`, made when missing: a free one, else the oldest
 * version's. */
static fr_div_version *entry_of(fr_div_aggregates *a, uint64_t version)
{
    fr_div_version *e = (fr_div_version *)fr_div_aggregates_find(a, version);
    if (e) return e;
    for (int i = 0; i < FR_DIV_VERSIONS && !e; i++)
        if (!a->v[i].used) e = &a->v[i];
    if (!e) {
        e = &a->v[0];
        for (int i = 1; i < FR_DIV_VERSIONS; i++)
            if (a->v[i].version < e->version) e = &a->v[i];
    }
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->version = version;
    fr_hist_init(&e->kl, FR_HIST_KL);
    fr_hist_init(&e->sample_kl, FR_HIST_KL);
    return e;
}

void fr_div_aggregates_add(fr_div_aggregates *a, uint64_t version, long position, const fr_kl_result *r)
{
    fr_div_version *e = entry_of(a, version);
    fr_div_summary_add(&e->bucket[fr_div_bucket_of(position)], r);
    fr_div_summary_add(&e->all, r);
    fr_hist_add(&e->kl, r->kl);
    a->positions_total++;
    a->kl_sum_total += r->kl;
}

void fr_div_aggregates_add_sample(fr_div_aggregates *a, uint64_t version, uint64_t request_id, int sample,
                                  const fr_div_summary *s)
{
    if (!s || s->n <= 0) return;
    fr_div_version *e = entry_of(a, version);
    const double mean = fr_div_summary_mean(s);
    fr_hist_add(&e->sample_kl, mean);
    int at = e->n_worst;   /* insertion point, highest mean first */
    while (at > 0 && e->worst[at - 1].kl_mean < mean) at--;
    if (at >= FR_DIV_WORST) return;
    const int keep = e->n_worst < FR_DIV_WORST ? e->n_worst : FR_DIV_WORST - 1;
    memmove(&e->worst[at + 1], &e->worst[at], sizeof e->worst[0] * (size_t)(keep - at));
    e->worst[at] = (fr_div_worst){.request_id = request_id, .sample = sample, .positions = s->n, .kl_mean = mean};
    if (e->n_worst < FR_DIV_WORST) e->n_worst++;
}

/* ---- the shadow ---- */

struct fr_shadow {
    fr_session s;
    int chunk;
    fr_step_seq *steps;
    fr_decode_row *rows;   /* greedy: the shadow's own draws are never used */
    int *keep;             /* 0, 1, ...: every row's logits are wanted */
    int cap;
    /* measuring on the device: rows 0, 1, ... of the shadow's decode, the
     * served rows and chosen tokens, the results */
    int *d_ref_rows, *d_served_rows, *d_chosen;
    fr_kl_result *d_out;
    int launched;          /* sequences of a launched step not yet waited for */
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
#ifdef FR_HAVE_CUDA
    cudaEvent_t kl_done;
#endif
};

fr_status fr_shadow_open(fr_session *main, int max_seqs, int n_blocks, fr_shadow **out)
{
    if (!main || !out) return fr_fail(FR_EINVAL, "fr_shadow_open: NULL argument");
    *out = NULL;
    if (max_seqs < 1 || n_blocks < 2)
        return fr_fail(FR_EINVAL, "shadow: %d sequences and %d KV blocks", max_seqs, n_blocks);
    fr_shadow *sh = calloc(1, sizeof *sh);
    if (!sh) return fr_fail(FR_ENOMEM, "shadow: out of memory");
    sh->chunk = 256;
    sh->cap = max_seqs;
    sh->steps = malloc(sizeof *sh->steps * (size_t)max_seqs);
    sh->rows = calloc((size_t)max_seqs, sizeof *sh->rows);
    sh->keep = malloc(sizeof *sh->keep * (size_t)max_seqs);
    sh->carried_rows = malloc(sizeof *sh->carried_rows * (size_t)max_seqs);
    for (int i = 0; sh->rows && sh->keep && i < max_seqs; i++) {
        sh->rows[i].params = (fr_sampling_params){.temperature = 0.0f, .top_k = 0, .top_p = 1.0f};
        sh->keep[i] = i;
    }
    const int step_tokens = sh->chunk > max_seqs ? sh->chunk : max_seqs;
    fr_status st = sh->steps && sh->rows && sh->keep && sh->carried_rows
                       ? fr_session_open_shadow(main, n_blocks, max_seqs, step_tokens, &sh->s)
                       : fr_fail(FR_ENOMEM, "shadow: out of memory");
    if (st) {
        free(sh->carried_rows);
        free(sh->rows);
        free(sh->keep);
        free(sh->steps);
        free(sh);
        return st;
    }
    *out = sh;
    return FR_OK;
}

void fr_shadow_close(fr_shadow **psh)
{
    fr_shadow *sh = psh ? *psh : NULL;
    if (!sh) return;
#ifdef FR_HAVE_CUDA
    if (sh->pending && sh->kl_done) cudaEventSynchronize(sh->kl_done);   /* nothing in flight writes freed memory */
    cudaFree(sh->d_ref_rows);
    cudaFree(sh->d_served_rows);
    cudaFree(sh->d_chosen);
    cudaFree(sh->d_out);
    cudaFree(sh->d_kl_ws);
    cudaFree(sh->d_used);
    cudaFree(sh->d_host_rows);
    cudaFreeHost(sh->h_ref_rows);
    cudaFreeHost(sh->h_served_rows);
    cudaFreeHost(sh->h_used);
    cudaFreeHost(sh->h_out);
    if (sh->kl_done) cudaEventDestroy(sh->kl_done);
#endif
    fr_session_close(&sh->s);
    free(sh->carried_rows);
    free(sh->rows);
    free(sh->keep);
    free(sh->steps);
    free(sh);
    *psh = NULL;
}

fr_status fr_shadow_start(fr_shadow *sh, const int *tokens, int n, int *shadow_seq, float *ref_logits)
{
    if (!sh || !tokens || n < 1 || !shadow_seq || !ref_logits)
        return fr_fail(FR_EINVAL, "fr_shadow_start: bad argument");
    const int need = (n + FR_PAGE_TOKENS - 1) / FR_PAGE_TOKENS;
    if (fr_kv_free_blocks(sh->s.kv) < need + 1)
        return fr_fail(FR_ENOMEM, "shadow: %d free KV blocks, a prompt of %d tokens needs %d",
                       fr_kv_free_blocks(sh->s.kv), n, need + 1);
    return fr_session_prefill(&sh->s, tokens, n, sh->chunk, shadow_seq, ref_logits, NULL);
}

fr_status fr_shadow_step(fr_shadow *sh, const int *shadow_seqs, const int *tokens, int n, float *ref_logits)
{
    if (!sh || n < 0 || n > sh->cap || (n && (!shadow_seqs || !tokens || !ref_logits)))
        return fr_fail(FR_EINVAL, "fr_shadow_step: bad argument");
    if (n == 0) return FR_OK;
    for (int i = 0; i < n; i++)
        sh->steps[i] = (fr_step_seq){.seq = shadow_seqs[i], .n = 1, .tokens = &tokens[i], .all_logits = 0};
    /* The decode path: on CUDA a replayed graph, and only these rows' logits
     * come back to the host. */
    return fr_session_decode_keep(&sh->s, sh->steps, sh->rows, n, NULL, NULL, sh->keep, n, ref_logits);
}

#ifdef FR_HAVE_CUDA
/* The device and pinned buffers of the measurement, made on first use
 * (all or none). */
static fr_status device_buffers(fr_shadow *sh)
{
    if (sh->d_ref_rows) return FR_OK;
    const size_t cap = (size_t)sh->cap;
    const int V = sh->s.model->cfg.vocab_size;
    sh->kl_ws_bytes = fr_kl_topk_cuda_ws_bytes(sh->cap, V, FR_KL_TOP_K);
    if (cudaMalloc((void **)&sh->d_ref_rows, sizeof(int) * cap) != cudaSuccess ||
        cudaMalloc((void **)&sh->d_served_rows, sizeof(int) * cap) != cudaSuccess ||
        cudaMalloc((void **)&sh->d_chosen, sizeof(int) * cap) != cudaSuccess ||
        cudaMalloc((void **)&sh->d_out, sizeof(fr_kl_result) * cap) != cudaSuccess ||
        cudaMalloc(&sh->d_kl_ws, sh->kl_ws_bytes) != cudaSuccess ||
        cudaMalloc((void **)&sh->d_used, sizeof(int) * cap) != cudaSuccess ||
        cudaMallocHost((void **)&sh->h_ref_rows, sizeof(int) * cap) != cudaSuccess ||
        cudaMallocHost((void **)&sh->h_served_rows, sizeof(int) * cap) != cudaSuccess ||
        cudaMallocHost((void **)&sh->h_used, sizeof(int) * cap) != cudaSuccess ||
        cudaMallocHost((void **)&sh->h_out, sizeof(fr_kl_result) * cap) != cudaSuccess ||
        cudaEventCreateWithFlags(&sh->kl_done, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        cudaFree(sh->d_ref_rows);
        cudaFree(sh->d_served_rows);
        cudaFree(sh->d_chosen);
        cudaFree(sh->d_out);
        cudaFree(sh->d_kl_ws);
        cudaFree(sh->d_used);
        cudaFreeHost(sh->h_ref_rows);
        cudaFreeHost(sh->h_served_rows);
        cudaFreeHost(sh->h_used);
        cudaFreeHost(sh->h_out);
        sh->d_ref_rows = sh->d_served_rows = sh->d_chosen = sh->d_used = NULL;
        sh->d_out = NULL;
        sh->d_kl_ws = NULL;
        sh->h_ref_rows = sh->h_served_rows = sh->h_used = NULL;
        sh->h_out = NULL;
        sh->kl_done = NULL;
        return fr_fail(FR_ENOMEM, "shadow: cannot allocate %zu rows of measurement buffers", cap);
    }
    return FR_OK;
}

/* D_t of n rows: reference rows ref_rows[j] of ref against served rows
 * served_rows[j] of served (device logits of finished decodes; row lists on
 * the host), on the default stream, results to out (host). */
static fr_status measure_on_device(fr_shadow *sh, const float *ref, const int *ref_rows, const float *served,
                                   const int *served_rows, const int *chosen, int n, fr_kl_result *out)
{
    const int V = sh->s.model->cfg.vocab_size;
    if (cudaMemcpy(sh->d_ref_rows, ref_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(sh->d_served_rows, served_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(sh->d_chosen, chosen, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "shadow: %s", cudaGetErrorString(cudaGetLastError()));
    fr_status st = fr_kl_topk_cuda_split(ref, sh->d_ref_rows, served, sh->d_served_rows, sh->d_chosen, 0, n, V,
                                         FR_KL_TOP_K, sh->d_kl_ws, sh->kl_ws_bytes, sh->d_out, NULL, 0);
    if (st) return st;
    if (cudaMemcpy(out, sh->d_out, sizeof(fr_kl_result) * (size_t)n, cudaMemcpyDeviceToHost) != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "shadow: the divergence kernel failed: %s", cudaGetErrorString(cudaGetLastError()));
    return FR_OK;
}
#endif

int fr_shadow_on_device(const fr_shadow *sh)
{
#ifdef FR_HAVE_CUDA
    return sh && sh->s.backend == FR_BACKEND_CUDA;
#else
    (void)sh;
    return 0;
#endif
}

fr_status fr_shadow_launch(fr_shadow *sh, const int *shadow_seqs, const int *tokens, int n)
{
    if (!fr_shadow_on_device(sh)) return fr_fail(FR_EUNSUPPORTED, "shadow: a launched step needs the CUDA backend");
    if (n < 1 || n > sh->cap || !shadow_seqs || !tokens) return fr_fail(FR_EINVAL, "fr_shadow_launch: bad argument");
    for (int i = 0; i < n; i++)
        sh->steps[i] = (fr_step_seq){.seq = shadow_seqs[i], .n = 1, .tokens = &tokens[i], .all_logits = 0};
    sh->launched = n;
    fr_status st = fr_session_decode_launch(&sh->s, sh->steps, sh->rows, n);
    if (st) sh->launched = 0;
    return st;
}

fr_status fr_shadow_wait_kl(fr_shadow *sh, fr_session *served, const int *served_rows, const int *chosen, int n,
                            fr_kl_result *out)
{
    if (!fr_shadow_on_device(sh) || !served || served->backend != sh->s.backend)
        return fr_fail(FR_EUNSUPPORTED, "shadow: measuring on the device needs the CUDA backend");
    if (n < 1 || n != sh->launched || !served_rows || !chosen || !out) {
        if (sh->launched) fr_session_decode_wait(&sh->s, sh->steps, sh->launched, NULL, NULL, NULL, 0, NULL);
        sh->launched = 0;
        return fr_fail(FR_EINVAL, "fr_shadow_wait_kl: bad argument");
    }
    sh->launched = 0;
    fr_status st = fr_session_decode_wait(&sh->s, sh->steps, n, NULL, NULL, NULL, 0, NULL);
    if (st) return st;
#ifdef FR_HAVE_CUDA
    st = device_buffers(sh);
    if (st) return st;
    return measure_on_device(sh, fr_runner_cuda_decode_logits(sh->s.gpu), sh->keep,
                             fr_runner_cuda_decode_logits(served->gpu), served_rows, chosen, n, out);
#else
    return fr_fail(FR_EUNSUPPORTED, "shadow: built without CUDA");
#endif
}

#ifdef FR_HAVE_CUDA
/* Enqueues the carried step's measurement behind its decode on the serving
 * stream: shadow rows first.. against served_rows, each with the token the
 * decode sampled for its served row, results to the pinned h_out. Returns
 * whether it was enqueued (when not, fr_shadow_carried_kl measures the
 * slow way). */
static int enqueue_carried_kl(fr_shadow *sh, fr_session *served, const int *served_rows, int n)
{
    if (!served_rows || device_buffers(sh)) return 0;
    for (int j = 0; j < n; j++) {
        if (served_rows[j] < 0) return 0;
        sh->h_served_rows[j] = served_rows[j];
    }
    const int first = fr_runner_cuda_rider_first_row(served->gpu);
    for (int j = 0; j < n; j++) sh->h_ref_rows[j] = first + j;
    const cudaStream_t stream = fr_runner_cuda_stream(served->gpu);
    const float *logits = fr_runner_cuda_decode_logits(served->gpu);
    const int V = sh->s.model->cfg.vocab_size;
    if (cudaMemcpyAsync(sh->d_ref_rows, sh->h_ref_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, stream) ||
        cudaMemcpyAsync(sh->d_served_rows, sh->h_served_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice,
                        stream) ||
        fr_kl_topk_cuda_split(logits, sh->d_ref_rows, logits, sh->d_served_rows,
                              fr_runner_cuda_decode_tokens(served->gpu), 1, n, V, FR_KL_TOP_K, sh->d_kl_ws,
                              sh->kl_ws_bytes, sh->d_out, sh->d_used, stream) ||
        cudaMemcpyAsync(sh->h_out, sh->d_out, sizeof(fr_kl_result) * (size_t)n, cudaMemcpyDeviceToHost, stream) ||
        cudaMemcpyAsync(sh->h_used, sh->d_used, sizeof(int) * (size_t)n, cudaMemcpyDeviceToHost, stream) ||
        cudaEventRecord(sh->kl_done, stream)) {
        cudaGetLastError();
        /* Whatever was enqueued finishes before the host reads or reuses a buffer. */
        cudaStreamSynchronize(stream);
        cudaGetLastError();
        return 0;
    }
    return 1;
}
#endif

fr_status fr_shadow_launch_carried(fr_shadow *sh, fr_session *served, const fr_step_seq *seqs, const fr_decode_row *rows,
                                   int n_seqs, const int *shadow_seqs, const int *tokens, int n,
                                   const int *served_rows)
{
    if (!fr_shadow_on_device(sh)) return fr_fail(FR_EUNSUPPORTED, "shadow: a carried step needs the CUDA backend");
    if (n < 1 || n > sh->cap || !shadow_seqs || !tokens)
        return fr_fail(FR_EINVAL, "fr_shadow_launch_carried: bad argument");
    for (int i = 0; i < n; i++)
        sh->steps[i] = (fr_step_seq){.seq = shadow_seqs[i], .n = 1, .tokens = &tokens[i], .all_logits = 0};
    sh->pending = 0;
    fr_status st = fr_session_decode_launch_carrying(served, seqs, rows, n_seqs, &sh->s, sh->steps, n);
#ifdef FR_HAVE_CUDA
    if (!st && served_rows && enqueue_carried_kl(sh, served, served_rows, n)) sh->pending = n;
#else
    (void)served_rows;
#endif
    return st;
}

fr_status fr_shadow_carried_kl(fr_shadow *sh, fr_session *served, const int *served_rows, const int *chosen, int n,
                               fr_kl_result *out)
{
    if (!fr_shadow_on_device(sh) || !served || served->backend != sh->s.backend)
        return fr_fail(FR_EUNSUPPORTED, "shadow: measuring on the device needs the CUDA backend");
    if (n < 1 || n > sh->cap || !served_rows || !chosen || !out)
        return fr_fail(FR_EINVAL, "fr_shadow_carried_kl: bad argument");
#ifdef FR_HAVE_CUDA
    const int pending = sh->pending;
    sh->pending = 0;
    if (pending == n && cudaEventSynchronize(sh->kl_done) == cudaSuccess) {
        /* Measured behind the decode: valid when it measured these rows with
         * the tokens the caller names (the decode's own draws). */
        int same = 1;
        for (int j = 0; j < n && same; j++) same = sh->h_served_rows[j] == served_rows[j] && sh->h_used[j] == chosen[j];
        if (same) {
            memcpy(out, sh->h_out, sizeof(fr_kl_result) * (size_t)n);
            return FR_OK;
        }
    }
    cudaGetLastError();
    fr_status st = device_buffers(sh);
    if (st) return st;
    /* The shadow's logits are the serving decode's rows after its own. */
    const int first = fr_runner_cuda_rider_first_row(served->gpu);
    for (int j = 0; j < n; j++) sh->carried_rows[j] = first + j;
    const float *logits = fr_runner_cuda_decode_logits(served->gpu);
    return measure_on_device(sh, logits, sh->carried_rows, logits, served_rows, chosen, n, out);
#else
    return fr_fail(FR_EUNSUPPORTED, "shadow: built without CUDA");
#endif
}

#ifdef FR_HAVE_CUDA
/* Index of row in rows[0..*n), added when missing. */
static int row_index(const float **rows, int *n, const float *row)
{
    for (int i = 0; i < *n; i++)
        if (rows[i] == row) return i;
    rows[*n] = row;
    return (*n)++;
}

/* fr_shadow_measure_rows on the device, on the shadow's stream: each
 * distinct host row sent once. */
static fr_status measure_rows_on_device(fr_shadow *sh, const float *const *ref, const float *const *served,
                                        const int *chosen, int n, fr_kl_result *out)
{
    fr_status st = device_buffers(sh);
    if (st) return st;
    if (sh->pending) {   /* a carried measurement never read back: done with its buffers first */
        cudaEventSynchronize(sh->kl_done);
        sh->pending = 0;
    }
    const float **rows = malloc(sizeof *rows * 2 * (size_t)n);
    if (!rows) return fr_fail(FR_ENOMEM, "shadow: out of memory");
    int n_rows = 0;
    for (int j = 0; j < n; j++) {
        sh->h_ref_rows[j] = row_index(rows, &n_rows, ref[j]);
        sh->h_served_rows[j] = row_index(rows, &n_rows, served[j]);
        sh->h_used[j] = chosen[j];
    }
    const int V = sh->s.model->cfg.vocab_size;
    const size_t row = sizeof(float) * (size_t)V;
    if (n_rows > sh->host_rows_cap) {
        cudaFree(sh->d_host_rows);
        sh->host_rows_cap = 0;
        if (cudaMalloc((void **)&sh->d_host_rows, row * (size_t)n_rows) != cudaSuccess) {
            cudaGetLastError();
            sh->d_host_rows = NULL;
            free(rows);
            return fr_fail(FR_ENOMEM, "shadow: cannot allocate %d rows of logits on the device", n_rows);
        }
        sh->host_rows_cap = n_rows;
    }
    const cudaStream_t stream = fr_runner_cuda_stream(sh->s.gpu);
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < n_rows && e == cudaSuccess; i++)
        e = cudaMemcpyAsync(sh->d_host_rows + (size_t)i * V, rows[i], row, cudaMemcpyHostToDevice, stream);
    free(rows);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(sh->d_ref_rows, sh->h_ref_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(sh->d_served_rows, sh->h_served_rows, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice,
                            stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(sh->d_chosen, sh->h_used, sizeof(int) * (size_t)n, cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess)
        st = fr_kl_topk_cuda_split(sh->d_host_rows, sh->d_ref_rows, sh->d_host_rows, sh->d_served_rows, sh->d_chosen,
                                   0, n, V, FR_KL_TOP_K, sh->d_kl_ws, sh->kl_ws_bytes, sh->d_out, NULL, stream);
    if (e == cudaSuccess && !st)
        e = cudaMemcpyAsync(sh->h_out, sh->d_out, sizeof(fr_kl_result) * (size_t)n, cudaMemcpyDeviceToHost, stream);
    cudaError_t w = cudaStreamSynchronize(stream);   /* also after a failure: the buffers are free after */
    if (st) return st;
    if (e != cudaSuccess || w != cudaSuccess)
        return fr_fail(FR_EINTERNAL, "shadow: measuring rows from the host failed: %s",
                       cudaGetErrorString(e != cudaSuccess ? e : w));
    memcpy(out, sh->h_out, sizeof(fr_kl_result) * (size_t)n);
    return FR_OK;
}
#endif

fr_status fr_shadow_measure_rows(fr_shadow *sh, const float *const *ref, const float *const *served, const int *chosen,
                                 int n, fr_kl_result *out)
{
    if (!sh || !ref || !served || !chosen || !out || n < 1 || n > sh->cap)
        return fr_fail(FR_EINVAL, "fr_shadow_measure_rows: bad argument");
    const int V = sh->s.model->cfg.vocab_size;
    for (int j = 0; j < n; j++) {
        if (!ref[j] || !served[j]) return fr_fail(FR_EINVAL, "fr_shadow_measure_rows: row %d is NULL", j);
        if (chosen[j] < -1 || chosen[j] >= V) return fr_fail(FR_EINVAL, "fr_shadow_measure_rows: token %d", chosen[j]);
    }
#ifdef FR_HAVE_CUDA
    if (fr_shadow_on_device(sh)) return measure_rows_on_device(sh, ref, served, chosen, n, out);
#endif
    for (int j = 0; j < n; j++) {
        fr_status st = fr_kl_topk(ref[j], served[j], V, FR_KL_TOP_K, chosen[j], &out[j]);
        if (st) return st;
    }
    return FR_OK;
}

fr_status fr_shadow_step_kl(fr_shadow *sh, fr_session *served, const int *shadow_seqs, const int *tokens, int n,
                            const int *served_rows, const int *chosen, fr_kl_result *out)
{
    if (n == 0) return FR_OK;
    fr_status st = fr_shadow_launch(sh, shadow_seqs, tokens, n);
    return st ? st : fr_shadow_wait_kl(sh, served, served_rows, chosen, n, out);
}

fr_status fr_shadow_fork(fr_shadow *sh, int src, int *dst)
{
    if (!sh || !dst) return fr_fail(FR_EINVAL, "fr_shadow_fork: NULL argument");
    return fr_session_fork(&sh->s, src, dst);
}

int fr_shadow_blocks_needed(const fr_shadow *sh, int seq) { return fr_kv_blocks_needed(sh->s.kv, seq, 1); }

void fr_shadow_drop(fr_shadow *sh, int shadow_seq)
{
    if (sh && shadow_seq >= 0) fr_kv_seq_free(sh->s.kv, shadow_seq);
}

void fr_shadow_capture_stats(const fr_shadow *sh, int *captures, double *seconds)
{
    fr_session_capture_stats(sh ? &sh->s : NULL, captures, seconds);
}

int fr_shadow_free_blocks(const fr_shadow *sh) { return sh ? fr_kv_free_blocks(sh->s.kv) : 0; }
