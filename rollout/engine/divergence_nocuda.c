/* The device side of divergence monitoring in a build without CUDA (nvcc
 * absent): no shadow runs on a device, so no meter is made and the shadow
 * measures on the host. Built only without CUDA, in place of
 * divergence_cuda.c. */
#include "rollout/engine/divergence_device.h"

#include <stddef.h>

static const char absent[] = "shadow: measuring on the device needs a build with CUDA";

fr_status fr_shadow_dev_new(const fr_session *shadow, int cap, fr_shadow_dev **out)
{
    (void)shadow, (void)cap;
    *out = NULL;
    return FR_OK;
}

void fr_shadow_dev_destroy(fr_shadow_dev **d)
{
    if (d) *d = NULL;
}

fr_status fr_shadow_dev_decodes(fr_shadow_dev *d, const fr_session *shadow, const fr_session *served,
                                const int *ref_rows, const int *served_rows, const int *chosen, int n,
                                fr_kl_result *out)
{
    (void)d, (void)shadow, (void)served, (void)ref_rows, (void)served_rows, (void)chosen, (void)n, (void)out;
    return fr_fail(FR_EUNSUPPORTED, "%s", absent);
}

void fr_shadow_dev_carried_launched(fr_shadow_dev *d, const fr_session *served, const int *served_rows, int n)
{
    (void)d, (void)served, (void)served_rows, (void)n;
}

fr_status fr_shadow_dev_carried(fr_shadow_dev *d, const fr_session *served, const int *served_rows,
                                const int *chosen, int n, fr_kl_result *out)
{
    (void)d, (void)served, (void)served_rows, (void)chosen, (void)n, (void)out;
    return fr_fail(FR_EUNSUPPORTED, "%s", absent);
}

fr_status fr_shadow_dev_rows(fr_shadow_dev *d, const fr_session *shadow, const float *const *ref,
                             const float *const *served, const int *chosen, int n, fr_kl_result *out)
{
    (void)d, (void)shadow, (void)ref, (void)served, (void)chosen, (void)n, (void)out;
    return fr_fail(FR_EUNSUPPORTED, "%s", absent);
}
