/* The device side of divergence monitoring (divergence.c): D_t measured
 * where the logits are when the shadow runs on a device, so no
 * vocabulary-sized rows cross to the host. divergence_cuda.c measures on
 * the GPU (rollout/engine/kl_cuda.h); in a build without CUDA,
 * divergence_nocuda.c makes no meter and the shadow measures on the host.
 * Private to rollout/engine/. */
#ifndef FR_DIVERGENCE_DEVICE_H
#define FR_DIVERGENCE_DEVICE_H

#include "rollout/engine/kl_metrics.h"
#include "rollout/engine/session.h"

typedef struct fr_shadow_dev fr_shadow_dev;

/* A meter of up to cap rows for the shadow session `shadow` (its buffers
 * made on first use), or NULL in *out (and FR_OK) when the shadow's
 * logits are not on a device: it measures on the host. */
fr_status fr_shadow_dev_new(const fr_session *shadow, int cap, fr_shadow_dev **out);
/* Waits for a measurement still in flight, then frees; NULL-safe. */
void fr_shadow_dev_destroy(fr_shadow_dev **d);

/* D_t of the shadow's last decode, rows ref_rows[j] of it, against rows
 * served_rows[j] of served's last decode, chosen[j] the served token; both
 * decodes finished. */
fr_status fr_shadow_dev_decodes(fr_shadow_dev *d, const fr_session *shadow, const fr_session *served,
                                const int *ref_rows, const int *served_rows, const int *chosen, int n,
                                fr_kl_result *out);
/* After served's decode carrying the shadow's n rows was launched (or
 * failed to launch: served_rows NULL): enqueues their measurement against
 * served_rows behind the decode on its stream, with the tokens it samples,
 * when it can; an earlier carried measurement not read back is forgotten. */
void fr_shadow_dev_carried_launched(fr_shadow_dev *d, const fr_session *served, const int *served_rows, int n);
/* The carried rows' D_t once served's decode is waited for: the enqueued
 * results when they measured served_rows with tokens chosen, else measured
 * now (the shadow's rows follow served's own in its decode). */
fr_status fr_shadow_dev_carried(fr_shadow_dev *d, const fr_session *served, const int *served_rows,
                                const int *chosen, int n, fr_kl_result *out);
/* D_t of rows given on the host (fr_shadow_measure_rows), each distinct
 * row sent once, on the shadow's stream. */
fr_status fr_shadow_dev_rows(fr_shadow_dev *d, const fr_session *shadow, const float *const *ref,
                             const float *const *served, const int *chosen, int n, fr_kl_result *out);

#endif
