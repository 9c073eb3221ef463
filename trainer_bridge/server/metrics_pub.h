/* The metrics snapshots on a ZeroMQ PUB socket (docs/metrics.md, "PUB
 * socket"): each snapshot the server publishes is sent as two frames, the
 * topic "fp4rollout.metrics" and the msgpack of the same object /metrics.json
 * serves. Trainers subscribe and log them (trainer_bridge/client/metrics_sub.h). */
#ifndef FR_METRICS_PUB_H
#define FR_METRICS_PUB_H

#include "base/fr_status.h"
#include "trainer_bridge/protocol/protocol.h"
#include "rollout/monitor/metrics.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_metrics_pub fr_metrics_pub;

/* A PUB socket in the ZeroMQ context zctx bound to endpoint. With
 * curve_secret_key (40 Z85 characters; NULL: off) it is a CURVE server and
 * the context's ZAP handler decides who may subscribe. */
fr_status fr_metrics_pub_open(void *zctx, const char *endpoint, const char *curve_secret_key, fr_metrics_pub **out);
/* The endpoint bound (a port 0 / '*' resolved). */
const char *fr_metrics_pub_endpoint(const fr_metrics_pub *p);
/* Publishes s without blocking: a subscriber that lags behind the socket's
 * high-water mark misses snapshots (each one is whole, so the next one is
 * as good). */
fr_status fr_metrics_pub_send(fr_metrics_pub *p, const fr_metrics_snapshot *s);
void fr_metrics_pub_close(fr_metrics_pub **p);

/* The msgpack of s (a map with the keys of fr_metrics_json), in a new
 * buffer (*out, *len; free it). */
fr_status fr_metrics_msgpack(const fr_metrics_snapshot *s, char **out, size_t *len);

#ifdef __cplusplus
}
#endif

#endif
