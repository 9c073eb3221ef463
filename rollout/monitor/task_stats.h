/* Statistics of task accuracy (docs/eval_task.md, "Statistics"): the Wilson
 * score interval of a proportion, McNemar's exact test of two
 * configurations scored on the same prompts, and the cells of an eval-task
 * report: per configuration, the accuracy of every (variant, context) group
 * of prompts and of all of them, each with its paired comparison against
 * the first configuration. */
#ifndef FR_TASK_STATS_H
#define FR_TASK_STATS_H

#include "base/fr_status.h"

/* The two-sided 95% Wilson score interval of k successes in n trials
 * (z = 1.959963984540054). n 0: [0, 1]. */
void fr_wilson95(long k, long n, double *lo, double *hi);

/* McNemar's exact test: the two-sided binomial p-value of the discordant
 * pairs, b (first right, second wrong) against c (first wrong, second
 * right) under p = 1/2: min(1, 2 P[X <= min(b, c)]), X ~ Bin(b + c, 1/2).
 * 1 when b + c is 0. */
double fr_mcnemar_exact(long b, long c);

/* One cell: n prompts of a group, k of them answered exactly, and against
 * the first configuration on the same prompts: b (the first right, this one
 * wrong), c (the first wrong, this one right), diff = (c - b) / n (this
 * accuracy minus the first's) and McNemar's exact p. */
typedef struct {
    long n, k;
    double acc, lo, hi;
    long b, c;
    double diff, p;
} fr_task_cell;

/* A group of prompts: every prompt of one variant at one context length,
 * or (variant "all", context -1) every prompt. */
typedef struct {
    char variant[32];
    int context;
} fr_task_group;

/* The cells of n_configs configurations over n_items prompts:
 * correct[c * n_items + i] is 1 when configuration c answered prompt i
 * exactly; item_variant[i] and item_context[i] say its group. Groups come
 * in the order the prompts first show them, then "all"; cells[c * n_groups
 * + g]. Both outputs malloc'ed. */
fr_status fr_task_cells(const unsigned char *correct, int n_configs, int n_items, const char *const *item_variant,
                        const int *item_context, fr_task_group **groups, int *n_groups, fr_task_cell **cells);

#endif
