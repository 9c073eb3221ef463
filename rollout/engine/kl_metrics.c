#include "rollout/engine/kl_metrics.h"

#include <math.h>
#include <stdlib.h>

/* log-softmax in double (the divergence of close distributions is a small
 * difference of large terms). */
static void log_softmax(const float *x, int n, double *out)
{
    double mx = -INFINITY, sum = 0.0;
    for (int i = 0; i < n; i++) mx = fmax(mx, x[i]);
    for (int i = 0; i < n; i++) sum += exp((double)x[i] - mx);
    double lse = mx + log(sum);
    for (int i = 0; i < n; i++) out[i] = (double)x[i] - lse;
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* The k-th largest of x[n] (1-based), by quickselect on a scratch copy. */
static double kth_largest(const double *x, int n, int k, double *tmp)
{
    for (int i = 0; i < n; i++) tmp[i] = x[i];
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        double pivot = tmp[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (tmp[i] > pivot) i++;
            while (tmp[j] < pivot) j--;
            if (i <= j) { double t = tmp[i]; tmp[i] = tmp[j]; tmp[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return tmp[want];
}

fr_status fr_kl_topk(const float *ref_logits, const float *logits, int vocab, int k, int token,
                     fr_kl_result *out)
{
    if (!ref_logits || !logits || !out || vocab < 1 || k < 1 || token >= vocab)
        return fr_fail(FR_EINVAL, "kl: invalid arguments");
    double *lp = malloc(sizeof(double) * (size_t)vocab * 2), *lq = lp ? lp + vocab : NULL;
    double *tmp = malloc(sizeof(double) * (size_t)vocab);
    if (!lp || !tmp) {
        free(lp); free(tmp);
        return fr_fail(FR_ENOMEM, "kl: out of memory");
    }
    log_softmax(ref_logits, vocab, lp);
    log_softmax(logits, vocab, lq);
    if (k > vocab) k = vocab;
    /* Tokens above the k-th largest, then ties at it by lowest id, k in all. */
    double thr = kth_largest(lp, vocab, k, tmp), kl = 0.0;
    int taken = 0;
    for (int v = 0; v < vocab; v++)
        if (lp[v] > thr) { kl += exp(lp[v]) * (lp[v] - lq[v]); taken++; }
    for (int v = 0; v < vocab && taken < k; v++)
        if (lp[v] == thr) { kl += exp(lp[v]) * (lp[v] - lq[v]); taken++; }
    out->kl = kl;
    out->top1_match = argmax(ref_logits, vocab) == argmax(logits, vocab);
    out->logp_diff = token >= 0 ? lq[token] - lp[token] : 0.0;
    free(lp); free(tmp);
    return FR_OK;
}
