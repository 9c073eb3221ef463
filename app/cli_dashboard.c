/* fp4rollout dashboard FILE: the divergence dashboard of a finished run,
 * served from the history a server appended to its metrics_log
 * (docs/metrics.md, "History"), until a signal. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "app/cli.h"
#include "rollout/monitor/metrics_history.h"
#include "rollout/monitor/metrics_http.h"

static const char usage_text[] =
    "usage: fp4rollout dashboard FILE [--bind ADDR] [--port N]\n"
    "  serve the dashboard of the run recorded in FILE (a serve configuration's\n"
    "  metrics_log) at http://ADDR:PORT/dashboard until interrupted; /history.json\n"
    "  holds the records, /health answers 200, /metrics is absent (no live server).\n"
    "  --bind ADDR   IPv4 address to listen on (default 127.0.0.1)\n"
    "  --port N      port (default 8090; 0: any free port, printed)\n";

static volatile sig_atomic_t stop_flag = 0;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

int fr_cli_dashboard(int argc, char **argv)
{
    if (fr_cli_wants_help(argc, argv)) {
        fputs(usage_text, stdout);
        return 0;
    }
    const char *path = NULL, *bind = "127.0.0.1";
    int port = 8090;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--bind") == 0 && i + 1 < argc) bind = argv[++i];
        else if (strcmp(argv[i], "--port") == 0 && i + 1 < argc) {
            if (fr_cli_int("dashboard", "--port", argv[++i], 0, 65535, &port)) return 2;
        } else if (argv[i][0] != '-' && !path) path = argv[i];
        else return fr_cli_usage_error("dashboard", "unknown or incomplete option '%s'", argv[i]);
    }
    if (!path) return fr_cli_usage_error("dashboard", "a metrics_log FILE is required");
    fr_metrics_history *hist;
    fr_metrics_http *h;
    if (fr_metrics_history_load(path, 2048, 1024, &hist)) {
        fprintf(stderr, "fp4rollout dashboard: %s\n", fr_last_error());
        return 1;
    }
    if (fr_metrics_http_start(bind, port, &h)) {
        fprintf(stderr, "fp4rollout dashboard: %s\n", fr_last_error());
        fr_metrics_history_free(&hist);
        return 1;
    }
    fr_metrics_http_serve_history(h, hist);   /* h owns it now */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    printf("dashboard of %s on http://%s:%d/dashboard (%d points, %d weight versions)\n", path, bind,
           fr_metrics_http_port(h), fr_metrics_history_points(hist), fr_metrics_history_versions(hist));
    fflush(stdout);
    while (!stop_flag) usleep(100000);   /* pause() could miss a signal that lands just before it */
    fr_metrics_http_stop(&h);
    return 0;
}
