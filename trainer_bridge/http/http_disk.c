/* /update_weights_from_disk (docs/http.md): a folder of safetensors files
 * sent to the engine as a trainer sends weights, through the protocol's
 * update messages on a control slot (update_weights_begin, the buckets with
 * their xxHash64, the commit), so the one set of rules
 * (rollout/engine/weight_check.h) and the one commit (fr_weight_commit)
 * decide: a bad name, shape or dtype is refused with the reason and the
 * serving weights stay as they were. The files are mapped, never copied:
 * each bucket's pieces point into them until the server answered it. A
 * thread of its own does it, so no HTTP thread waits on the engine. */
#include "trainer_bridge/http/http_internal.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/safetensors.h"

#define DISK_BUCKET_BYTES ((uint64_t)64 << 20)
#define DISK_MAX_FILES 1024

typedef struct {
    http_call *c;
    char path[4096];
    int has_version;
    uint64_t version;
    fr_st_file *files[DISK_MAX_FILES];
    int n_files;
    const fr_st_tensor **t;     /* every tensor of every file */
    int n_t;
    char why[1024];             /* a failure of ours (not the server's) */
} disk_job;

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The folder's *.safetensors, in name order, and their tensors. */
static int open_folder(disk_job *j)
{
    DIR *d = opendir(j->path);
    if (!d) return snprintf(j->why, sizeof j->why, "model_path %.900s: cannot open the folder", j->path), -1;
    char *names[DISK_MAX_FILES];
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < DISK_MAX_FILES;) {
        size_t len = strlen(e->d_name);
        if (len > 12 && !strcmp(e->d_name + len - 12, ".safetensors")) names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, by_name);
    int bad = n == 0 ? (snprintf(j->why, sizeof j->why, "model_path %.900s: no .safetensors file there", j->path), 1) : 0;
    for (int i = 0; i < n; i++) {
        char full[8192];
        snprintf(full, sizeof full, "%s/%s", j->path, names[i] ? names[i] : "");
        if (!bad && (!names[i] || fr_st_file_open(full, &j->files[j->n_files])))
            bad = (snprintf(j->why, sizeof j->why, "model_path: %s", fr_last_error()), 1);
        else if (!bad) j->n_files++;
        free(names[i]);
    }
    for (int f = 0; !bad && f < j->n_files; f++) j->n_t += fr_st_file_count(j->files[f]);
    if (!bad && !(j->t = malloc(sizeof *j->t * (size_t)(j->n_t ? j->n_t : 1))))
        bad = (snprintf(j->why, sizeof j->why, "out of memory"), 1);
    for (int f = 0, k = 0; !bad && f < j->n_files; f++)
        for (int i = 0; i < fr_st_file_count(j->files[f]); i++) {
            const fr_st_tensor *t = fr_st_file_tensor(j->files[f], i);
            if (t->dtype != FR_DTYPE_F32 && t->dtype != FR_DTYPE_BF16 && t->dtype != FR_DTYPE_F16) {
                snprintf(j->why, sizeof j->why, "%s: dtype is not f32, bf16 or f16", t->name);
                bad = 1;
                break;
            }
            j->t[k++] = t;
        }
    return bad ? -1 : 0;
}

/* Sends m (with payload frames) on the call's slot and waits for the
 * answer: 0, or -1 with the server's error in c->code and c->message. */
static int ask(disk_job *j, const fr_msg *m, const fr_bridge_frame *frames, int n_frames)
{
    http_call *c = j->c;
    fr_http *h = c->h;
    char *data;
    size_t len;
    if (fr_msg_encode(m, &data, &len))
        return snprintf(j->why, sizeof j->why, "%s", fr_last_error()), -1;
    pthread_mutex_lock(&h->mu);
    c->waiting = 1;
    c->got = FR_MSG_NONE;
    pthread_mutex_unlock(&h->mu);
    fr_status st = fr_bridge_server_local_send(h->srv, c->slot, 1, data, len, frames, n_frames);
    free(data);
    pthread_mutex_lock(&h->mu);
    if (st) c->waiting = 0;
    while (c->waiting && !h->stopping) pthread_cond_wait(&c->cv, &h->mu);
    const int ok = !st && !h->stopping && c->got != FR_MSG_ERROR && c->got != FR_MSG_NONE;
    if (st || h->stopping) snprintf(c->message, sizeof c->message, "%s", st ? fr_last_error() : "the server is shutting down");
    pthread_mutex_unlock(&h->mu);
    return ok ? 0 : -1;
}

static int send_begin(disk_job *j)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_UPDATE_BEGIN);
    fr_msg_update_begin *b = &m.u.update_begin;
    b->version = j->version;
    b->n_tensors = j->n_t;
    b->bucket_bytes = DISK_BUCKET_BYTES;
    b->tensors = calloc((size_t)(j->n_t ? j->n_t : 1), sizeof *b->tensors);
    if (!b->tensors) return snprintf(j->why, sizeof j->why, "out of memory"), -1;
    for (int i = 0; i < j->n_t; i++) {
        fr_msg_tensor *x = &b->tensors[i];
        snprintf(x->name, sizeof x->name, "%s", j->t[i]->name);
        x->dtype = j->t[i]->dtype;
        x->ndim = j->t[i]->ndim;
        memcpy(x->shape, j->t[i]->shape, sizeof(int64_t) * (size_t)x->ndim);
        b->total_bytes += j->t[i]->nbytes;
    }
    int r = ask(j, &m, NULL, 0);
    free(b->tensors);
    return r;
}

typedef struct {
    fr_msg_piece *pieces;
    fr_bridge_frame *frames;
    int n, bucket;
    uint64_t used;
    XXH64_state_t *xs;
} bucket_state;

enum { MAX_PIECES = 4096 };

/* Sends the bucket filled so far (none: nothing). */
static int flush_bucket(disk_job *j, bucket_state *b)
{
    if (b->n == 0) return 0;
    fr_msg m;
    fr_msg_init(&m, FR_MSG_UPDATE_BUCKET);
    m.u.update_bucket = (fr_msg_update_bucket){.version = j->version, .bucket = b->bucket++,
                                               .xxh64 = XXH64_digest(b->xs), .pieces = b->pieces, .n_pieces = b->n};
    int rc = ask(j, &m, b->frames, b->n);
    b->n = 0;
    b->used = 0;
    XXH64_reset(b->xs, 0);
    return rc;
}

/* The buckets: tensors in order, cut into pieces of at most a bucket. */
static int send_buckets(disk_job *j)
{
    bucket_state b = {.pieces = malloc(sizeof(fr_msg_piece) * MAX_PIECES),
                      .frames = malloc(sizeof(fr_bridge_frame) * MAX_PIECES), .xs = XXH64_createState()};
    int rc = !b.pieces || !b.frames || !b.xs ? (snprintf(j->why, sizeof j->why, "out of memory"), -1) : 0;
    if (!rc) XXH64_reset(b.xs, 0);
    for (int i = 0; !rc && i < j->n_t; i++) {
        const fr_st_tensor *t = j->t[i];
        const uint64_t elem = fr_dtype_size(t->dtype);
        for (uint64_t off = 0; !rc && off < t->nbytes;) {
            uint64_t take = t->nbytes - off, room = DISK_BUCKET_BYTES - b.used;
            if (take > room) take = room / elem * elem;
            if (take == 0 || b.n == MAX_PIECES) {
                rc = flush_bucket(j, &b);
                continue;
            }
            fr_msg_piece *p = &b.pieces[b.n];
            memset(p, 0, sizeof *p);
            snprintf(p->t.name, sizeof p->t.name, "%s", t->name);
            p->t.dtype = t->dtype;
            p->t.ndim = t->ndim;
            memcpy(p->t.shape, t->shape, sizeof(int64_t) * (size_t)p->t.ndim);
            p->offset = off;
            p->nbytes = take;
            b.frames[b.n] = (fr_bridge_frame){.data = (const char *)t->data + off, .len = take};
            XXH64_update(b.xs, b.frames[b.n].data, (size_t)take);
            b.n++;
            b.used += take;
            off += take;
        }
    }
    if (!rc) rc = flush_bucket(j, &b);
    if (b.xs) XXH64_freeState(b.xs);
    free(b.pieces);
    free(b.frames);
    return rc;
}

static void answer(disk_job *j, int ok, uint64_t serving)
{
    http_call *c = j->c;
    c->answer.len = 0;
    if (ok) {
        fr_buf_printf(&c->answer, "{\"success\":true,\"message\":\"committed %d tensors from ", j->n_t);
        fr_buf b = {0};
        http_json_str(&b, j->path, strlen(j->path));
        fr_buf_put(&c->answer, b.data + 1, b.len - 2);
        fr_buf_free(&b);
        fr_buf_printf(&c->answer, "\",\"weight_version\":\"%llu\"}", (unsigned long long)serving);
        http_ready(c, 200, "application/json");
        return;
    }
    const char *why = j->why[0] ? j->why : c->message;
    fr_buf_printf(&c->answer, "{\"success\":false,\"code\":\"%s\",\"message\":", j->why[0] ? "bad_request" : c->code);
    http_json_str(&c->answer, why, strlen(why));
    fr_buf_printf(&c->answer, "}");
    http_ready(c, 400, "application/json");
}

static void *disk_thread(void *arg)
{
    disk_job *j = arg;
    http_call *c = j->c;
    int ok = open_folder(j) == 0;
    uint64_t serving = 0;
    if (ok && !j->has_version) {   /* the next version after the one serving */
        fr_msg m;
        fr_msg_init(&m, FR_MSG_STATS);
        ok = ask(j, &m, NULL, 0) == 0;
        j->version = c->u[2] + 1;
    }
    int begun = 0;
    if (ok) ok = (begun = send_begin(j) == 0);
    if (ok) ok = send_buckets(j) == 0;
    if (ok) {
        fr_msg m;
        fr_msg_init(&m, FR_MSG_UPDATE_COMMIT);
        m.u.update_end.version = j->version;
        ok = ask(j, &m, NULL, 0) == 0;
        serving = c->u[0];
    }
    if (!ok && begun && j->why[0]) {   /* our own failure mid-way: the server drops the staging */
        fr_msg m;
        fr_msg_init(&m, FR_MSG_UPDATE_ABORT);
        m.u.update_end.version = j->version;
        ask(j, &m, NULL, 0);
    }
    for (int f = 0; f < j->n_files; f++) fr_st_file_close(&j->files[f]);
    free(j->t);
    pthread_mutex_lock(&c->h->mu);
    answer(j, ok, serving);
    c->worker = 0;
    http_release_slot(c);
    http_maybe_free(c);
    pthread_mutex_unlock(&c->h->mu);
    free(j);
    return NULL;
}

void http_disk_start(http_call *c)
{
    cJSON *o = c->body.len ? cJSON_ParseWithLength(c->body.data, c->body.len) : NULL;
    const cJSON *path = o ? cJSON_GetObjectItemCaseSensitive(o, "model_path") : NULL;
    const cJSON *ver = o ? cJSON_GetObjectItemCaseSensitive(o, "weight_version") : NULL;
    disk_job *j = NULL;
    if (!cJSON_IsObject(o) || !cJSON_IsString(path) || !path->valuestring[0]) {
        http_fail(c, 400, "invalid_request_error", "model_path: a folder of safetensors files is required");
    } else if (ver && !cJSON_IsNull(ver) && !(cJSON_IsNumber(ver) && ver->valuedouble >= 1 && ver->valuedouble <= 9007199254740992.0) &&
               !(cJSON_IsString(ver) && strtoull(ver->valuestring, NULL, 10) >= 1)) {
        http_fail(c, 400, "invalid_request_error", "weight_version: a whole number >= 1 (or its decimal string)");
    } else if (!(j = calloc(1, sizeof *j)) || !http_take_slot(c)) {
        http_fail(c, 503, "unavailable", "too many control calls at once, or out of memory");
    } else {
        j->c = c;
        snprintf(j->path, sizeof j->path, "%s", path->valuestring);
        if (ver && !cJSON_IsNull(ver)) {
            j->has_version = 1;
            j->version = cJSON_IsNumber(ver) ? (uint64_t)ver->valuedouble : strtoull(ver->valuestring, NULL, 10);
        }
        pthread_t t;
        c->worker = 1;
        if (pthread_create(&t, NULL, disk_thread, j)) {
            c->worker = 0;
            http_release_slot(c);
            http_fail(c, 503, "unavailable", "cannot start a thread");
        } else {
            pthread_detach(t);
            j = NULL;
        }
    }
    free(j);
    cJSON_Delete(o);
}
