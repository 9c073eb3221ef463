/* Wilson intervals, McNemar's exact test and the cells of eval-task. */
#include "rollout/monitor/task_stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fr_wilson95(long k, long n, double *lo, double *hi)
{
    if (n <= 0) {
        *lo = 0.0;
        *hi = 1.0;
        return;
    }
    const double z = 1.959963984540054, z2 = z * z, nn = (double)n, p = (double)k / nn;
    const double denom = 1.0 + z2 / nn, centre = (p + z2 / (2.0 * nn)) / denom;
    const double half = z / denom * sqrt(p * (1.0 - p) / nn + z2 / (4.0 * nn * nn));
    /* Rounding must not push the bounds past what a proportion can be. */
    *lo = fmax(0.0, centre - half);
    *hi = fmin(1.0, centre + half);
}

double fr_mcnemar_exact(long b, long c)
{
    const long n = b + c, m = b < c ? b : c;
    if (n <= 0) return 1.0;
    /* Terms in log space: C(n, i) / 2^n underflows a double from n ~ 1075. */
    const double ln2n = (double)n * log(2.0), lgn = lgamma((double)n + 1.0);
    double tail = 0.0;
    for (long i = 0; i <= m; i++) tail += exp(lgn - lgamma((double)i + 1.0) - lgamma((double)(n - i) + 1.0) - ln2n);
    return fmin(1.0, 2.0 * tail);
}

/* The index of (variant, context) in groups[0, *n), added when new. */
static int group_of(fr_task_group *groups, int *n, const char *variant, int context)
{
    for (int g = 0; g < *n; g++)
        if (groups[g].context == context && strcmp(groups[g].variant, variant) == 0) return g;
    snprintf(groups[*n].variant, sizeof groups[*n].variant, "%s", variant);
    groups[*n].context = context;
    return (*n)++;
}

static void cell_finish(fr_task_cell *x)
{
    x->acc = x->n ? (double)x->k / (double)x->n : 0.0;
    fr_wilson95(x->k, x->n, &x->lo, &x->hi);
    x->diff = x->n ? (double)(x->c - x->b) / (double)x->n : 0.0;
    x->p = fr_mcnemar_exact(x->b, x->c);
}

fr_status fr_task_cells(const unsigned char *correct, int n_configs, int n_items, const char *const *item_variant,
                        const int *item_context, fr_task_group **groups_out, int *n_groups, fr_task_cell **cells_out)
{
    *groups_out = NULL;
    *cells_out = NULL;
    *n_groups = 0;
    if (n_configs < 1 || n_items < 1) return fr_fail(FR_EINVAL, "no configuration or no prompt to score");
    fr_task_group *groups = calloc((size_t)n_items + 1, sizeof *groups);
    int *of = malloc(sizeof(int) * (size_t)n_items), ng = 0;
    if (!groups || !of) {
        free(groups);
        free(of);
        return fr_fail(FR_ENOMEM, "out of memory");
    }
    for (int i = 0; i < n_items; i++) of[i] = group_of(groups, &ng, item_variant[i], item_context[i]);
    snprintf(groups[ng].variant, sizeof groups[ng].variant, "all");
    groups[ng++].context = -1;
    fr_task_cell *cells = calloc((size_t)n_configs * (size_t)ng, sizeof *cells);
    if (!cells) {
        free(groups);
        free(of);
        return fr_fail(FR_ENOMEM, "out of memory");
    }
    for (int c = 0; c < n_configs; c++)
        for (int i = 0; i < n_items; i++) {
            const int mine = correct[(size_t)c * (size_t)n_items + (size_t)i] != 0, first = correct[i] != 0;
            for (int pass = 0; pass < 2; pass++) {   /* its group, then "all" */
                fr_task_cell *x = &cells[(size_t)c * (size_t)ng + (size_t)(pass ? ng - 1 : of[i])];
                x->n++;
                x->k += mine;
                x->b += first && !mine;
                x->c += !first && mine;
            }
        }
    for (size_t j = 0; j < (size_t)n_configs * (size_t)ng; j++) cell_finish(&cells[j]);
    free(of);
    *groups_out = groups;
    *n_groups = ng;
    *cells_out = cells;
    return FR_OK;
}
