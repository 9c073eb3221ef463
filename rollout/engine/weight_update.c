/* Weight updates (rollout/engine/weight_update.h): a stage that holds the
 * values (weight_stage.h) under the rules that say what may arrive and when
 * it is whole (weight_check.h), and the commit. */
#include "rollout/engine/weight_update.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rollout/engine/weight_stage.h"
#include "rollout/model/tensor_table.h"
#include "rollout/model/weights_cuda.h"

struct fr_weight_update {
    fr_weight_stage *stage;
    fr_weight_check *rules;
    int spent;                /* committed by move: the stage holds the previous weights */
    unsigned char *touched;   /* commit scratch: tensors with bytes received */
};

fr_status fr_weight_dtype_parse(const char *s, fr_dtype *out)
{
    fr_dtype t;
    if (!s || !fr_dtype_from_file_name(s, strlen(s), &t) || !fr_dtype_is_weight(t))
        return fr_fail(FR_EINVAL, "weight dtype '%s' (expected F32, BF16 or F16)", s ? s : "(null)");
    *out = t;
    return FR_OK;
}

/* The rules for cfg's tensors around a stage made by the caller. */
static fr_status begin(const fr_model_config *cfg, uint64_t version, fr_weight_stage *stage, fr_weight_update **out)
{
    fr_weight_update *u = calloc(1, sizeof *u);
    if (u) u->stage = stage;
    fr_status st = u ? fr_weight_check_new(cfg, &u->rules) : fr_fail(FR_ENOMEM, "weight update: out of memory");
    const size_t n = fr_model_tensor_count(cfg);
    if (!st && !(u->touched = calloc(n ? n : 1, 1))) st = fr_fail(FR_ENOMEM, "weight update: out of memory");
    if (st) {
        if (u) fr_weight_update_free(&u);
        else stage->ops->destroy(stage);
        return st;
    }
    fr_weight_check_open(u->rules, version);
    *out = u;
    return FR_OK;
}

fr_status fr_weight_update_begin(const fr_model_config *cfg, uint64_t version, fr_weight_update **out)
{
    if (!cfg || !out) return fr_fail(FR_EINVAL, "fr_weight_update_begin: NULL argument");
    *out = NULL;
    fr_weight_stage *stage;
    fr_status st = fr_weight_stage_host_new(cfg, &stage);
    return st ? st : begin(cfg, version, stage, out);
}

fr_status fr_weight_update_begin_for(const fr_session *s, uint64_t version, fr_weight_update **out)
{
    if (!s || !s->model || !out) return fr_fail(FR_EINVAL, "fr_weight_update_begin_for: NULL argument");
    *out = NULL;
    if (s->backend != FR_BACKEND_CUDA) return fr_weight_update_begin(&s->model->cfg, version, out);
    fr_weight_stage *stage;
    fr_status st = fr_weight_stage_device_new(s, &stage);
    return st ? st : begin(&s->model->cfg, version, stage, out);
}

fr_status fr_weight_update_begin_shard_for(const fr_session *s, uint64_t version, fr_weight_update **out)
{
    if (!s || !s->model || !out) return fr_fail(FR_EINVAL, "fr_weight_update_begin_shard_for: NULL argument");
    *out = NULL;
    if (s->backend != FR_BACKEND_CUDA || !s->gpu_weights || s->gpu_weights->tp_size <= 1)
        return fr_weight_update_begin_for(s, version, out);
    fr_weight_stage *stage;
    fr_status st = fr_weight_stage_device_shard_new(s, &stage);
    return st ? st : begin(&s->model->cfg, version, stage, out);
}

int fr_weight_update_is_shard(const fr_weight_update *u) { return u && u->stage->shard; }

fr_status fr_weight_update_restart(fr_weight_update *u, uint64_t version)
{
    if (!u) return fr_fail(FR_EINVAL, "fr_weight_update_restart: NULL update");
    fr_status st = u->stage->ops->restart(u->stage);
    if (st) return st;
    fr_weight_check_open(u->rules, version);
    u->spent = 0;
    return FR_OK;
}

fr_status fr_weight_update_set_partial(fr_weight_update *u, int partial)
{
    if (!u) return fr_fail(FR_EINVAL, "fr_weight_update_set_partial: NULL update");
    fr_weight_check_set_partial(u->rules, partial);
    return FR_OK;
}

int fr_weight_update_is_partial(const fr_weight_update *u) { return u && fr_weight_check_partial(u->rules); }
int fr_weight_update_on_device(const fr_weight_update *u) { return u && u->stage->on_device; }

void fr_weight_update_free(fr_weight_update **pu)
{
    fr_weight_update *u = pu ? *pu : NULL;
    if (!u) return;
    fr_weight_check_free(&u->rules);
    free(u->touched);
    if (u->stage) u->stage->ops->destroy(u->stage);
    free(u);
    *pu = NULL;
}

uint64_t fr_weight_update_version(const fr_weight_update *u) { return u ? fr_weight_check_version_of(u->rules) : 0; }
uint64_t fr_weight_update_bytes(const fr_weight_update *u) { return u ? fr_weight_check_bytes(u->rules) : 0; }

int fr_weight_update_tensor_count(const fr_weight_update *u) { return u ? fr_weight_check_tensor_count(u->rules) : 0; }

int fr_weight_update_find(const fr_weight_update *u, const char *name)
{
    return u ? fr_weight_check_find(u->rules, name) : -1;
}

fr_status fr_weight_update_tensor(const fr_weight_update *u, int i, const char **name, int *ndim, int64_t shape[2])
{
    if (!u) return fr_fail(FR_EINVAL, "weight update: NULL");
    return fr_weight_check_tensor(u->rules, i, name, ndim, shape);
}

const fr_model *fr_weight_update_model(const fr_weight_update *u) { return u ? u->stage->host : NULL; }

/* A spent update's stage holds the weights of the version before it. */
static fr_status spent(const fr_weight_update *u, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_UPDATE_STATE;
    return fr_fail(FR_EINVAL, "the update to version %llu was committed already",
                   (unsigned long long)fr_weight_update_version(u));
}

fr_status fr_weight_update_declare(fr_weight_update *u, const fr_weight_begin *b, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_FAILED;
    if (!u || !b) return fr_fail(FR_EINVAL, "fr_weight_update_declare: NULL argument");
    fr_status st = fr_weight_update_restart(u, b->version);
    return st ? st : fr_weight_check_begin(u->rules, b, why);
}

/* The values of accepted bucket b into the stage, piece by piece. */
static fr_status store(fr_weight_update *u, const fr_weight_bucket *b, fr_weight_refusal *why)
{
    for (int k = 0; k < b->n_pieces; k++) {
        const fr_weight_piece *p = &b->pieces[k];
        const size_t es = fr_dtype_size(p->t.dtype);
        if (!p->bytes)
            return fr_weight_check_fail(u->rules, FR_WREF_FAILED, fr_fail(FR_EINVAL, "weight update: the piece of "
                                        "\"%s\" carries no bytes", p->t.name), why);
        size_t bad = 0;
        /* Straight into the stage: the range holds nothing received yet, so
         * a piece refused halfway leaves the staged tensor as it was (its
         * unreceived bytes are not part of it). */
        fr_status st = u->stage->ops->put(u->stage, p->tensor, p->t.dtype, (size_t)(p->offset / es), p->bytes,
                                          (size_t)(p->nbytes / es), &bad);
        if (st == FR_EFORMAT) {
            fr_weight_check_done(u->rules, b, NULL, k, bad, why);
            return FR_EFORMAT;
        }
        if (st) return fr_weight_check_fail(u->rules, st == FR_ENOMEM ? FR_WREF_OUT_OF_MEMORY : FR_WREF_FAILED, st, why);
    }
    return FR_OK;
}

fr_status fr_weight_update_bucket(fr_weight_update *u, fr_weight_bucket *b, const uint64_t *checksum,
                                  fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_BAD_MESSAGE;
    if (!u || !b) return fr_fail(FR_EINVAL, "fr_weight_update_bucket: NULL argument");
    if (u->spent) return spent(u, why);
    fr_status st = fr_weight_check_bucket(u->rules, b, checksum, why);
    if (!st && (st = store(u, b, why)) == FR_EFORMAT) st = FR_EINVAL;   /* a refusal like any other (non_finite) */
    return st ? st : fr_weight_check_done(u->rules, b, NULL, -1, 0, why);
}

fr_status fr_weight_update_plan(fr_weight_update *u, fr_weight_bucket *b, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_BAD_MESSAGE;
    if (!u || !b) return fr_fail(FR_EINVAL, "fr_weight_update_plan: NULL argument");
    if (u->spent) return spent(u, why);
    return fr_weight_check_bucket(u->rules, b, NULL, why);
}

fr_status fr_weight_update_done(fr_weight_update *u, const fr_weight_bucket *b, const uint64_t *checksum,
                                int bad_piece, uint64_t bad_element, fr_weight_refusal *why)
{
    if (why) *why = FR_WREF_BAD_MESSAGE;
    if (!u || !b) return fr_fail(FR_EINVAL, "fr_weight_update_done: NULL argument");
    return fr_weight_check_done(u->rules, b, checksum, bad_piece, bad_element, why);
}

fr_status fr_weight_update_fail(fr_weight_update *u, fr_weight_refusal r, fr_status st, fr_weight_refusal *why)
{
    if (why) *why = r;
    return u ? fr_weight_check_fail(u->rules, r, st, why) : st;
}

uint16_t *fr_weight_update_device_dst(fr_weight_update *u, int i)
{
    if (!u || !u->stage->on_device || i < 0 || i >= fr_weight_update_tensor_count(u) || u->spent) return NULL;
    return u->stage->dev_dst[i];
}

fr_status fr_weight_update_put(fr_weight_update *u, const char *name, fr_dtype dtype, const int64_t *shape,
                               int ndim, uint64_t offset, const void *bytes, size_t n_bytes)
{
    if (!u || !name || !shape || (n_bytes && !bytes))
        return fr_fail(FR_EINVAL, "fr_weight_update_put: NULL argument");
    if (u->spent) return spent(u, NULL);
    fr_weight_piece p = {.t = {.name = name, .dtype = dtype, .ndim = ndim}, .offset = offset, .nbytes = n_bytes,
                         .bytes = bytes};
    for (int d = 0; d < ndim && d < FR_WEIGHT_MAX_NDIM; d++) p.t.shape[d] = shape[d];
    fr_weight_bucket b = {.version = fr_weight_update_version(u), .bucket = fr_weight_check_buckets(u->rules),
                          .nbytes = n_bytes, .pieces = &p, .n_pieces = 1};
    fr_status st = fr_weight_check_bucket(u->rules, &b, NULL, NULL);
    if (st) return st;
    if ((st = store(u, &b, NULL))) {
        fr_weight_check_unaccept(u->rules, &b);
        return st;
    }
    return fr_weight_check_done(u->rules, &b, NULL, -1, 0, NULL);
}

fr_status fr_weight_update_ready(const fr_weight_update *u, fr_weight_refusal *why)
{
    if (!u) {
        if (why) *why = FR_WREF_UPDATE_STATE;
        return fr_fail(FR_EINVAL, "fr_weight_update_ready: NULL update");
    }
    return u->spent ? spent(u, why) : fr_weight_check_ready(u->rules, why);
}

typedef struct {
    const fr_weight_update *u;
    int i;
} same_shape;

/* Whether the session's next tensor is the update's, name and shape. */
static fr_status compare(void *user, const fr_model_tensor *m)
{
    same_shape *k = user;
    const char *name;
    int ndim;
    int64_t shape[2];
    if (fr_weight_update_tensor(k->u, k->i++, &name, &ndim, shape) || strcmp(name, m->name) != 0 || ndim != m->ndim ||
        shape[0] != m->rows || (m->ndim == 2 && shape[1] != m->cols))
        return FR_EINVAL;
    return FR_OK;
}

/* The switch of a ready update: the session's model must have its shape. */
static fr_status switch_in(fr_session *s, fr_weight_update *u, int move)
{
    same_shape k = {u, 0};
    const fr_weights none = {0};
    const int n = fr_weight_update_tensor_count(u);
    if ((size_t)n != fr_model_tensor_count(&s->model->cfg) || fr_model_tensors_each(&s->model->cfg, &none, compare, &k))
        return fr_fail(FR_EINVAL, "the update was staged for another model shape");
    int all = 1;
    for (int i = 0; i < n; i++) all &= (u->touched[i] = (unsigned char)fr_weight_check_received(u->rules, i));
    fr_status st = u->stage->ops->commit(u->stage, s, u->touched, all, move);
    if (!st && move) u->spent = 1;
    return st;
}

fr_status fr_session_commit_weights(fr_session *s, const fr_weight_update *u)
{
    if (!s || !u) return fr_fail(FR_EINVAL, "fr_session_commit_weights: NULL argument");
    fr_status st = fr_weight_update_ready(u, NULL);
    return st ? st : switch_in(s, (fr_weight_update *)u, 0);
}

fr_status fr_session_commit_weights_move(fr_session *s, fr_weight_update *u)
{
    if (!s || !u) return fr_fail(FR_EINVAL, "fr_session_commit_weights_move: NULL argument");
    fr_status st = fr_weight_update_ready(u, NULL);
    return st ? st : switch_in(s, u, 1);
}

/* This rank's answer to "is the update to `version` whole here?". */
static fr_status ready_here(const fr_session *s, const fr_weight_update *u, uint64_t version, fr_weight_refusal *why)
{
    if (!s || !u) {
        if (why) *why = FR_WREF_UPDATE_STATE;
        return fr_fail(FR_EINVAL, "no update to version %llu is staged here", (unsigned long long)version);
    }
    if (fr_weight_update_version(u) != version) {
        if (why) *why = FR_WREF_UPDATE_STATE;
        return fr_fail(FR_EINVAL, "the update staged here is to version %llu, not %llu",
                       (unsigned long long)fr_weight_update_version(u), (unsigned long long)version);
    }
    return fr_weight_update_ready(u, why);
}

fr_weight_switch fr_weight_commit(fr_session *s, fr_weight_update *u, uint64_t version, const fr_mpi_world *w,
                                  fr_weight_refusal *why)
{
    fr_weight_refusal r = FR_WREF_NONE;
    const int several = w && w->size > 1;
    fr_status st = ready_here(s, u, version, &r);
    int all = st == FR_OK;
    if (several && fr_mpi_world_all_ok(w, st == FR_OK, &all)) {
        if (why) *why = FR_WREF_FAILED;
        return FR_WEIGHTS_NO_VOTE;
    }
    if (!all) {
        if (!st) {
            r = FR_WREF_FAILED;
            fr_fail(FR_EIO, "update to version %llu: not every rank could stage it (their logs say why)",
                    (unsigned long long)version);
        }
        if (why) *why = r;
        return FR_WEIGHTS_KEPT;
    }
    st = switch_in(s, u, 1);
    if (why) *why = st ? FR_WREF_FAILED : FR_WREF_NONE;
    if (!several) return st ? FR_WEIGHTS_KEPT : FR_WEIGHTS_SWITCHED;
    char mine[512];
    snprintf(mine, sizeof mine, "%s", st ? fr_last_error() : "");
    if (fr_mpi_world_all_ok(w, st == FR_OK, &all)) {
        if (why) *why = FR_WREF_FAILED;
        return FR_WEIGHTS_NO_VOTE;
    }
    if (all) return FR_WEIGHTS_SWITCHED;
    if (why) *why = FR_WREF_FAILED;
    fr_fail(FR_EIO, "weight version %llu was switched in on some ranks only (%s); the engines no longer agree on "
                    "their weights", (unsigned long long)version, st ? mine : "this rank switched");
    return FR_WEIGHTS_SPLIT;
}
