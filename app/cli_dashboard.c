/* fp4rollout dashboard FILE: the divergence dashboard of a finished run,
 * served from the history a server appended to its metrics_log
 * (docs/metrics.md, "History"), until a signal. */
#include <stdio.h>
#include <unistd.h>

#include "app/cli.h"
#include "rollout/monitor/metrics_history.h"
#include "rollout/monitor/metrics_http.h"

const char fr_dashboard_usage[] =
    "usage: fp4rollout dashboard FILE [--bind ADDR] [--port N]\n"
    "\n"
    "Serves the dashboard of the run recorded in FILE (a serve configuration's\n"
    "metrics_log) at http://ADDR:PORT/dashboard until interrupted; /history.json\n"
    "holds the records, /health answers 200, /metrics is absent (no live server).\n";

int fr_cli_dashboard(const fr_cli_values *v)
{
    const fr_cmd cmd = FR_CMD_DASHBOARD;
    if (v->n_operands == 0) return fr_cli_usage_error(cmd, "a metrics_log FILE is required");
    const char *path = v->operands[0], *bind = fr_opt_str(v, FR_O_BIND);
    fr_metrics_history *hist;
    fr_metrics_http *h;
    if (fr_metrics_history_load(path, 2048, 1024, &hist)) return fr_cli_fail(cmd, 1);
    if (fr_metrics_http_start(bind, fr_opt_int(v, FR_O_DASHBOARD_PORT), &h)) {
        fr_metrics_history_free(&hist);
        return fr_cli_fail(cmd, 1);
    }
    fr_metrics_http_serve_history(h, hist);   /* h owns it now */
    volatile sig_atomic_t *stop = fr_cli_catch_stop();
    printf("dashboard of %s on http://%s:%d/dashboard (%d points, %d weight versions)\n", path, bind,
           fr_metrics_http_port(h), fr_metrics_history_points(hist), fr_metrics_history_versions(hist));
    fflush(stdout);
    while (!*stop) usleep(100000);   /* pause() could miss a signal that lands just before it */
    fr_metrics_http_stop(&h);
    return 0;
}
