#include "rollout/engine/histogram.h"

#include <math.h>
#include <string.h>

/* Latency buckets follow the spacing latency dashboards are used to (fine
 * below a second, coarse above); KL spans what FP4 and FP8 caches give
 * (1e-4 .. 1e-2 nats) with room either side. */
static const double latency[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 120.0};
static const double token_time[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
                                    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0};
static const double kl[] = {1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3,
                            2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0};

const double *fr_hist_bounds(fr_hist_kind kind, int *n)
{
    switch (kind) {
    case FR_HIST_TOKEN_TIME: *n = (int)(sizeof token_time / sizeof *token_time); return token_time;
    case FR_HIST_KL: *n = (int)(sizeof kl / sizeof *kl); return kl;
    default: *n = (int)(sizeof latency / sizeof *latency); return latency;
    }
}

void fr_hist_init(fr_hist *h, fr_hist_kind kind)
{
    memset(h, 0, sizeof *h);
    h->kind = kind >= 0 && kind < FR_HIST_KINDS ? (int)kind : FR_HIST_LATENCY;
}

void fr_hist_add(fr_hist *h, double x)
{
    if (!isfinite(x)) return;   /* a NaN would poison the sum for good */
    int n;
    const double *b = fr_hist_bounds((fr_hist_kind)h->kind, &n);
    int i = 0;
    while (i < n && x > b[i]) i++;
    h->count[i]++;
    h->n++;
    h->sum += x;
}

double fr_hist_quantile(const fr_hist *h, double q)
{
    if (h->n == 0) return NAN;
    int n;
    const double *b = fr_hist_bounds((fr_hist_kind)h->kind, &n);
    const double rank = q * (double)h->n;
    long long below = 0;
    for (int i = 0; i < n; i++) {
        if ((double)(below + h->count[i]) >= rank && h->count[i] > 0) {
            const double lo = i ? b[i - 1] : 0.0, frac = (rank - (double)below) / (double)h->count[i];
            return lo + (b[i] - lo) * (frac < 0 ? 0 : frac);
        }
        below += h->count[i];
    }
    return b[n - 1];
}

void fr_serving_stats_init(fr_serving_stats *s)
{
    memset(s, 0, sizeof *s);
    fr_hist_init(&s->ttft, FR_HIST_LATENCY);
    fr_hist_init(&s->tpot, FR_HIST_TOKEN_TIME);
    fr_hist_init(&s->e2e, FR_HIST_LATENCY);
}
