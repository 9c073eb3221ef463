/* The HTTP API of `fp4rollout serve` (docs/http.md): SGLang's native
 * endpoints (/generate and its control endpoints) and OpenAI's
 * /v1/completions and /v1/models, beside /metrics, /health and /dashboard,
 * on one libmicrohttpd server in the same process as the ZeroMQ bridge.
 * Requests reach the engine through the serve loop as in-process clients
 * of the bridge (trainer_bridge/server/server.h, fr_bridge_server_local_*):
 * no HTTP thread calls the engine; results come back through the loop's
 * sink into a queue per call.
 *
 *     fr_http *h;
 *     fr_http_start(&cfg, srv, &h);         // after fr_bridge_server_new, before run
 *     fr_bridge_server_run(srv, &stop);
 *     fr_http_stop(&h);                     // after run, before the server's destroy
 */
#ifndef FR_HTTP_H
#define FR_HTTP_H

#include <stddef.h>

#include "base/fr_status.h"
#include "trainer_bridge/server/server.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_http fr_http;

typedef struct {
    const char *bind;              /* IPv4 address, NULL: 127.0.0.1; "*" or "0.0.0.0": every interface */
    int port;                      /* 0: any free port (fr_http_port says which) */
    int port_fallback;             /* a taken port gives way to any free one (logged) */
    int max_connections;           /* 0: 4096 */
    int idle_timeout_s;            /* an idle connection is closed after this long; 0: 10 */
    long long max_body_bytes;      /* a larger request body is refused with 413; 0: 64 MiB */
    int threads;                   /* libmicrohttpd's threads (epoll each); 0: 4 */
    /* Tokens (docs/http.md, "Tokens and roles"), each "Authorization:
     * Bearer TOKEN"; NULL or "": none. read: metrics, health, dashboard;
     * client: generation, abort, model and server info; trainer:
     * everything (pause, weights, memory). A role without a token of its
     * own is open: to anyone for read, to loopback peers only for client
     * and trainer. A token grants its role and the roles below it. */
    const char *read_token, *client_token, *trainer_token;
    /* The model's name in /v1/models and responses. Text in and out is
     * the server's tokenizer's (fr_bridge_server_tokenizer); without one
     * text is refused and answers carry token ids only. */
    const char *model_name;
    FILE *log;                     /* NULL: the program's log */
} fr_http_config;

/* Starts the server on srv (world rank 0's, made and not yet run): opens
 * the bridge's in-process clients and listens. FR_EIO naming the address
 * when it cannot listen. */
fr_status fr_http_start(const fr_http_config *cfg, fr_bridge_server *srv, fr_http **out);
int fr_http_port(const fr_http *h);
/* Ends every call still open (503: the server is shutting down), stops the
 * server and frees it; NULL-safe. Call after fr_bridge_server_run returned. */
void fr_http_stop(fr_http **h);

#ifdef __cplusplus
}
#endif

#endif
