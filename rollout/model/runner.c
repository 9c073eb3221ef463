/* The runner interface's calls, forwarded to the backend (runner.h). */
#include "rollout/model/runner.h"

#include <stddef.h>
#include <stdlib.h>

fr_status fr_runner_open(const fr_runner_config *c, fr_runner **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_runner_open: out is NULL");
    *out = NULL;
    if (!c || !c->model || !c->kv) return fr_fail(FR_EINVAL, "fr_runner_open: no model or KV cache");
    return c->gpu ? fr_runner_cuda_open(c, out) : fr_runner_cpu_open(c, out);
}

fr_status fr_runner_backend_new(const char *who, const fr_runner_config *c, const fr_runner_ops *ops, int on_device,
                                size_t size, fr_runner **out)
{
    if (!out) return fr_fail(FR_EINVAL, "%s: out is NULL", who);
    *out = NULL;
    if (on_device && (!c || !c->gpu || !c->kv)) return fr_fail(FR_EINVAL, "%s: no device weights or KV cache", who);
    if (!on_device && (!c || !c->model || !c->kv)) return fr_fail(FR_EINVAL, "%s: no model or KV cache", who);
    fr_runner *r = calloc(1, size);
    if (!r) return fr_fail(FR_ENOMEM, "%s: out of memory", who);
    *r = (fr_runner){.ops = ops, .on_device = on_device};
    *out = r;
    return FR_OK;
}

void fr_runner_destroy(fr_runner **r)
{
    if (!r || !*r) return;
    (*r)->ops->destroy(*r);
    *r = NULL;
}

fr_status fr_runner_run(fr_runner *r, const fr_batch *b)
{
    if (!r || !b) return fr_fail(FR_EINVAL, "fr_runner_run: no runner or batch");
    return r->ops->run(r, b);
}

fr_status fr_runner_fork(fr_runner *r, int src_seq, int dst_seq)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_runner_fork: no runner");
    return r->ops->fork ? r->ops->fork(r, src_seq, dst_seq) : FR_OK;
}

fr_status fr_runner_set_key_mean(fr_runner *r, const float *key_mean)
{
    if (!r || !key_mean) return fr_fail(FR_EINVAL, "fr_runner_set_key_mean: NULL argument");
    return r->ops->set_key_mean ? r->ops->set_key_mean(r, key_mean) : FR_OK;
}

fr_status fr_runner_set_observer(fr_runner *r, const fr_forward_observer *obs)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_runner_set_observer: no runner");
    return r->ops->set_observer(r, obs);
}

fr_status fr_runner_set_deterministic(fr_runner *r, int on)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_runner_set_deterministic: no runner");
    return r->ops->set_deterministic(r, on);
}

fr_status fr_runner_weights_changed(fr_runner *r)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_runner_weights_changed: no runner");
    return r->ops->weights_changed(r);
}

fr_status fr_runner_capture_routes(fr_runner *r, int on)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_runner_capture_routes: no runner");
    return r->ops->capture_routes(r, on);
}

fr_status fr_runner_routes(fr_runner *r, const int *rows, int n, uint16_t *out)
{
    if (!r || n < 0 || (n && (!rows || !out))) return fr_fail(FR_EINVAL, "fr_runner_routes: bad argument");
    return n ? r->ops->routes(r, rows, n, out) : FR_OK;
}

void fr_runner_capture_stats(const fr_runner *r, int *captures, double *seconds)
{
    *captures = 0;
    *seconds = 0.0;
    if (r && r->ops->capture_stats) r->ops->capture_stats(r, captures, seconds);
}

fr_status fr_runner_memory(fr_runner *r, int release)
{
    if (!r) return fr_fail(FR_EINVAL, "fr_runner_memory: no runner");
    return r->ops->memory ? r->ops->memory(r, release) : FR_OK;
}

int fr_runner_on_device(const fr_runner *r) { return r && r->on_device; }
