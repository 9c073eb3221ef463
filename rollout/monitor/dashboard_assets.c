/* The dashboard's files, embedded in the binary at build time: the page
 * (dashboard.html) and the charting library vendored in vendor/uplot/
 * (docs/metrics.md says why uPlot). The assembler's .incbin reads them from
 * the repository root, where the build runs; the Makefile makes this object
 * depend on them. Each is followed by a NUL so it can be read as a string. */
#include "rollout/monitor/metrics_http.h"

#define FR_EMBED(sym, path)                                                                  \
    __asm__(".section .rodata\n.balign 16\n.globl " #sym "\n.type " #sym ", @object\n" #sym ":\n" \
            ".incbin \"" path "\"\n.globl " #sym "_end\n" #sym "_end:\n.byte 0\n.previous\n")

FR_EMBED(fr_metrics_dashboard_html, "rollout/monitor/dashboard.html");
FR_EMBED(fr_metrics_uplot_js, "rollout/monitor/vendor/uplot/uPlot.iife.min.js");
FR_EMBED(fr_metrics_uplot_css, "rollout/monitor/vendor/uplot/uPlot.min.css");
