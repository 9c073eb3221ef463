/* The CUDA runner's entry points in a build without CUDA (nvcc absent):
 * there is no device to run on, and every call says so. Built only without
 * CUDA, in place of runner_cuda.c and runner_batch_cuda.c
 * (docs/architecture.md, "Conventions"). */
#include "rollout/model/runner.h"

static const char absent[] = "this build has no CUDA support (nvcc was absent)";

fr_status fr_runner_cuda_open(const fr_runner_config *c, fr_runner **out)
{
    (void)c;
    if (out) *out = NULL;
    return fr_fail(FR_EUNSUPPORTED, "the CUDA runner: %s", absent);
}

int fr_cuda_built(void) { return 0; }

int fr_cuda_available(void) { return 0; }

const char *fr_cuda_absence(void) { return absent; }
