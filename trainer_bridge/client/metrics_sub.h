/* The trainer's side of the metrics PUB socket (docs/metrics.md, "PUB
 * socket"): subscribe to a server's snapshots and read each as the JSON
 * object /metrics.json serves. Part of the client library. */
#ifndef FR_METRICS_SUB_H
#define FR_METRICS_SUB_H

#include "trainer_bridge/client/client.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_metrics_sub fr_metrics_sub;

/* A SUB socket connected to endpoint (the server's metrics_pub_port), with
 * CURVE keys when the server has CURVE on (NULL: off). ZeroMQ connects
 * lazily, and a subscriber sees only snapshots published after it has
 * joined. */
fr_status fr_metrics_sub_new(const char *endpoint, const fr_client_curve *keys, fr_metrics_sub **out);
/* The next snapshot as JSON (*json malloc'ed: fr_client_free_string), or
 * *json NULL when none came within timeout_ms (-1: wait forever). */
fr_status fr_metrics_sub_next(fr_metrics_sub *s, int timeout_ms, char **json);
void fr_metrics_sub_destroy(fr_metrics_sub **s);

#ifdef __cplusplus
}
#endif

#endif
