/* fp4rollout-client push-weights: a model's tensors (a checkpoint folder
 * or synthetic:NAME[:SEED], loaded by the engine's model code) sent as one
 * weight update, or written to a file instead; options to send them
 * damaged, for testing a server's checks. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "app/client_cli.h"
#include "base/clock.h"
#include "rollout/model/model.h"
#include "rollout/model/tensor_table.h"

/* float32 -> bfloat16, round to nearest even (finite inputs). */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The tensors as the client sends them, and the copies they point to. */
typedef struct {
    fr_client_tensor *t;
    int64_t (*shapes)[2];
    void **owned;          /* converted or altered copies */
    int n, k;              /* the model's tensors, the ones sent */
    int bf16;
    uint64_t bytes;
} tensor_set;

static void tensor_set_free(tensor_set *ts)
{
    for (int i = 0; ts->owned && i < ts->n; i++) free(ts->owned[i]);
    free(ts->owned);
    free(ts->shapes);
    free(ts->t);
}

/* The data of tensor src as sent: itself, or a copy in bf16 and/or with a
 * NaN in its middle (--nan). */
static fr_status tensor_data(tensor_set *ts, const float *src, size_t count, int altered, const void **data)
{
    *data = src;
    if (!ts->bf16 && !altered) return FR_OK;
    void *copy = ts->owned[ts->k] = malloc(count * (ts->bf16 ? 2 : 4));
    if (!copy) return fr_fail(FR_ENOMEM, "out of memory");
    if (ts->bf16)
        for (size_t e = 0; e < count; e++) ((uint16_t *)copy)[e] = to_bf16(src[e]);
    else memcpy(copy, src, count * 4);
    if (altered && ts->bf16) ((uint16_t *)copy)[count / 2] = 0x7fc0;
    else if (altered) ((float *)copy)[count / 2] = NAN;
    *data = copy;
    return FR_OK;
}

/* The model's tensors as the options ask (--skip, --nan, --flatten, --dtype). */
static fr_status collect(const fr_cli_values *v, const fr_model_tensor *mt, size_t n_mt, tensor_set *ts)
{
    const char *skip = fr_opt_str(v, FR_O_SKIP), *nan_name = fr_opt_str(v, FR_O_NAN_TENSOR);
    const char *flat = fr_opt_str(v, FR_O_FLATTEN);
    ts->n = (int)n_mt;
    ts->bf16 = fr_opt_int(v, FR_O_DTYPE) == FR_DTYPE_BF16;
    ts->t = calloc(n_mt ? n_mt : 1, sizeof *ts->t);
    ts->shapes = calloc(n_mt ? n_mt : 1, sizeof *ts->shapes);
    ts->owned = calloc(n_mt ? n_mt : 1, sizeof *ts->owned);
    if (!ts->t || !ts->shapes || !ts->owned) return fr_fail(FR_ENOMEM, "out of memory");
    for (int i = 0; i < ts->n; i++) {
        const char *name = mt[i].name;
        int ndim = mt[i].ndim;
        if (!mt[i].data) return fr_fail(FR_EINVAL, "the model has no tensor %s", name);
        if (skip && strcmp(skip, name) == 0) continue;
        int64_t *shape = ts->shapes[ts->k];
        shape[0] = mt[i].rows;
        shape[1] = ndim == 2 ? mt[i].cols : 1;
        const size_t count = (size_t)shape[0] * (size_t)shape[1];
        const void *data;
        fr_status st = tensor_data(ts, mt[i].data, count, nan_name && strcmp(nan_name, name) == 0, &data);
        if (st) return st;
        if (flat && strcmp(flat, name) == 0 && ndim == 2) {
            shape[0] *= shape[1];
            ndim = 1;
        }
        ts->t[ts->k++] = (fr_client_tensor){.name = name, .dtype = ts->bf16 ? FR_DTYPE_BF16 : FR_DTYPE_F32,
                                            .ndim = ndim, .shape = shape, .data = data};
        ts->bytes += count * (ts->bf16 ? 2 : 4);
    }
    return FR_OK;
}

/* --export: the tensors to a file, their names and shapes to stdout. */
static fr_status export_to(const char *path, const tensor_set *ts)
{
    FILE *f = fopen(path, "wb");
    if (!f) return fr_fail(FR_EIO, "cannot write %s: %s", path, strerror(errno));
    int ok = 1;
    for (int i = 0; ok && i < ts->k; i++) {
        const fr_client_tensor *t = &ts->t[i];
        size_t count = (size_t)t->shape[0] * (size_t)(t->ndim == 2 ? t->shape[1] : 1);
        ok = fwrite(t->data, ts->bf16 ? 2 : 4, count, f) == count;
        printf("{\"name\":\"%s\",\"shape\":[%lld", t->name, (long long)t->shape[0]);
        if (t->ndim == 2) printf(",%lld", (long long)t->shape[1]);
        printf("]}\n");
    }
    if (fclose(f) || !ok) return fr_fail(FR_EIO, "cannot write %s", path);
    return FR_OK;
}

/* The update sent and committed; one JSON line either way. */
static int send_update(const fr_client_ctx *ctx, const fr_cli_values *v, const tensor_set *ts)
{
    const long long bucket = fr_opt_given(v, FR_O_BUCKET_BYTES) ? fr_opt_long(v, FR_O_BUCKET_BYTES)
                                                                : (long long)fr_opt_int(v, FR_O_BUCKET_MIB) << 20;
    const int corrupt = fr_opt_given(v, FR_O_CORRUPT_BUCKET) ? fr_opt_int(v, FR_O_CORRUPT_BUCKET) : -1;
    fr_client_update_opts opts = {.bucket_bytes = (uint64_t)bucket, .partial = fr_opt_int(v, FR_O_PARTIAL),
                                  .corrupt_bucket = corrupt};
    fr_client *c;
    if (fr_client_connect(ctx, v->cmd, &c)) return 1;
    const double t0 = fr_now_s();
    fr_msg_update_reply r;
    int rc = 0;
    if (fr_client_update_weights(c, ts->t, ts->k, (uint64_t)fr_opt_long(v, FR_O_WEIGHT_VERSION), &opts, &r)) {
        const char *code = "", *msg = "";
        fr_client_last_error(c, &code, &msg, NULL);
        rc = fr_cli_fail(v->cmd, 1);
        printf("{\"committed\":false,\"code\":\"%s\"}\n", code);
    } else {
        const double dt = fr_now_s() - t0;
        const uint64_t nb = (ts->bytes + (uint64_t)bucket - 1) / (uint64_t)bucket;
        printf("{\"committed\":true,\"version\":%llu,\"weight_version\":%llu,\"tensors\":%d,\"bytes\":%llu,"
               "\"buckets_at_least\":%llu,\"seconds\":%.6f,\"mib_per_s\":%.1f}\n",
               (unsigned long long)r.version, (unsigned long long)r.weight_version, ts->k,
               (unsigned long long)ts->bytes, (unsigned long long)nb, dt, (double)ts->bytes / (1 << 20) / dt);
    }
    fflush(stdout);
    fr_client_destroy(&c);
    return rc;
}

int fr_client_cmd_push_weights(const fr_client_ctx *ctx, const fr_cli_values *v)
{
    const char *export_path = fr_opt_str(v, FR_O_EXPORT);
    if (!fr_opt_given(v, FR_O_WEIGHT_VERSION) && !export_path)
        return fr_cli_usage_error(v->cmd, "--version is required (or --export)");
    fr_model *m = NULL;
    fr_model_tensor *mt = NULL;   /* the model's tensors (rollout/model/tensor_table.h) */
    size_t n_mt = 0;
    tensor_set ts = {0};
    fr_status st = fr_model_load(fr_opt_str(v, FR_O_MODEL), &m);
    if (!st) st = fr_model_tensor_list(&m->cfg, &m->w, &mt, &n_mt);
    if (!st) st = collect(v, mt, n_mt, &ts);
    if (!st && export_path) st = export_to(export_path, &ts);
    int rc = st ? fr_cli_fail(v->cmd, 1) : export_path ? 0 : send_update(ctx, v, &ts);
    tensor_set_free(&ts);
    free(mt);
    fr_model_destroy(&m);
    return rc;
}
