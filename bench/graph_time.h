/* The time of one call of a kernel sequence as the benches take it: `iters`
 * calls of `enqueue` captured in one CUDA graph, replayed once to warm up and
 * once timed between two events; the mean per call in ms, or a negative
 * number when a CUDA call fails (its error left for the caller's next check).
 * Header-only, for the C and CUDA programs of bench/. */
#ifndef FR_BENCH_GRAPH_TIME_H
#define FR_BENCH_GRAPH_TIME_H

#include <cuda_runtime.h>

typedef void (*fr_bench_enqueue_fn)(void *user, cudaStream_t st);

static double fr_bench_graph_ms(fr_bench_enqueue_fn enqueue, void *user, int iters, cudaStream_t st)
{
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ms = -1.0f;
    if (cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) != cudaSuccess) return -1.0;
    for (int i = 0; i < iters; i++) enqueue(user, st);
    int ok = cudaStreamEndCapture(st, &graph) == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess &&
             cudaGraphLaunch(exec, st) == cudaSuccess && cudaStreamSynchronize(st) == cudaSuccess &&
             cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess &&
             cudaEventRecord(e0, st) == cudaSuccess && cudaGraphLaunch(exec, st) == cudaSuccess &&
             cudaEventRecord(e1, st) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
             cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    return ok ? (double)ms / iters : -1.0;
}

#endif
