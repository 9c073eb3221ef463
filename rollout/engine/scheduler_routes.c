/* Routed-expert replay in the scheduler (docs/deepseek_moe.md, "Routed-expert
 * replay"): for samples whose request asks, the experts every MoE layer
 * chose at the row that drew each of their tokens, fetched from the runner
 * after the step and packed into the sample's records. Nothing of it runs
 * while no open request asks: the runner's capture is off and no row is
 * planned. */
#include "rollout/engine/scheduler_internal.h"

#include <stdlib.h>

/* Room for n entries in an int array (capacity *cap); -1 out of memory. */
static int grow_ints(int **p, int *cap, int n)
{
    return sch_grow((void **)p, cap, n, sizeof(int));
}

/* The runner captures while an open request asks for routes. */
static fr_status switch_capture(fr_scheduler *sch)
{
    const int want = sch->route_reqs > 0;
    if (want == sch->capturing) return FR_OK;
    fr_status st = fr_session_capture_routes(sch->s, want);
    if (!st) sch->capturing = want;
    return st;
}

fr_status sch_schedule_routes(fr_scheduler *sch, step_plan *p)
{
    p->n_routes = 0;
    fr_status st = switch_capture(sch);
    if (st || !sch->capturing) return st;
    if (grow_ints(&sch->route_at, &sch->cap_route_at, p->n_rows) ||
        grow_ints(&sch->route_trow, &sch->cap_route_trow, p->n_rows))
        return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    int n = 0, trow = 0;
    for (int row = 0; row < p->n_rows; row++) {
        const int m = sch->rows[row].n;
        int wants;
        if (row < p->n_dec) {
            wants = sch->row_samples[row]->r->routes;
        } else {   /* a prefill job's last chunk draws its samples' first tokens */
            const job *j = &sch->prefill[row - p->n_dec];
            wants = j->r->routes && j->done + m >= j->n_total;
        }
        sch->route_at[row] = wants ? n : -1;
        if (wants) sch->route_trow[n++] = trow + m - 1;   /* the row's last token drew */
        trow += m;
    }
    const size_t per = (size_t)sch->route_layers * (size_t)sch->route_k;
    if (n && sch_grow((void **)&sch->route_buf, &sch->cap_route_buf, (int)(per * (size_t)n), sizeof(uint16_t)))
        return fr_fail(FR_ENOMEM, "scheduler: out of memory");
    p->n_routes = n;
    return FR_OK;
}

fr_status sch_fetch_routes(fr_scheduler *sch, const step_plan *p)
{
    if (!p->n_routes) return FR_OK;
    return fr_session_routes(sch->s, sch->route_trow, p->n_routes, sch->route_buf);
}

const uint16_t *sch_route_of(const fr_scheduler *sch, int row)
{
    if (!sch->capturing || row < 0 || row >= sch->cap_route_at || sch->route_at[row] < 0) return NULL;
    return sch->route_buf + (size_t)sch->route_at[row] * (size_t)sch->route_layers * (size_t)sch->route_k;
}

void sch_keep_route(const fr_scheduler *sch, sample *x, const uint16_t *route)
{
    if (!x->routes || !route) return;
    const size_t ids = (size_t)sch->route_layers * (size_t)sch->route_k;
    uint8_t *dst = x->routes + (size_t)x->n * ids * (size_t)sch->route_width;
    for (size_t i = 0; i < ids; i++) {
        if (sch->route_width == 1) {
            dst[i] = (uint8_t)route[i];
        } else {   /* little endian, whatever the host */
            dst[2 * i] = (uint8_t)(route[i] & 0xff);
            dst[2 * i + 1] = (uint8_t)(route[i] >> 8);
        }
    }
}
