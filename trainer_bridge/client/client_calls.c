/* Calls the server answers with one reply (trainer_bridge/client/client.h):
 * hello, stats, pause, resume, abort, as structs and as JSON, and the
 * helpers the weight updates share (client_internal.h). Each call waits for
 * its own reply: replies meet calls by type, oldest first, so calls from
 * several threads do not take each other's answers. */
#include "trainer_bridge/client/client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"

/* The limit of a wait: the client's timeout (-1), none (-2), or wait_ms. */
static int limit_of(const fr_client *c, int wait_ms)
{
    return wait_ms == -1 ? c->timeout_ms : wait_ms == -2 ? -1 : wait_ms;
}

fr_status fr_client_await_locked(fr_client *c, ticket *t, int wait_ms, const char *what, fr_msg *reply)
{
    const int limit = limit_of(c, wait_ms);
    const double until = fr_client_until(limit);
    fr_status st = FR_OK;
    while (t->state != TICKET_ANSWERED && !st && (limit < 0 || fr_now_ms() < until))
        st = fr_client_pump_locked(c, until);
    if (t->state != TICKET_ANSWERED) {
        t->state = TICKET_ABANDONED;   /* its reply, when it comes, is dropped */
        if (st) return st;
        if (!c->heard)
            return fr_fail(FR_EIO, "client: cannot reach a server at %s: nothing answered within %d ms "
                                   "(is fp4rollout serve running there?)",
                           c->endpoint, limit);
        return fr_fail(FR_EIO, "client: no answer to %s from %s within %d ms", what, c->endpoint, limit);
    }
    fr_client_unlink_ticket_locked(c, t);
    fr_msg r = t->reply;
    free(t);
    if (r.type == FR_MSG_NONE)
        return fr_fail(FR_EIO, "client: the connection to %s ended before the server answered %s", c->endpoint, what);
    if (r.type == FR_MSG_ERROR) {
        /* the calling thread's failure when its call takes it, not when it
         * arrives: an update's second refusal may arrive before the first
         * is taken */
        char text[160];
        snprintf(text, sizeof text, "server refused %s", what);
        st = fr_client_server_error_(&r.u.error, text);
        fr_msg_free(&r);
        return st;
    }
    *reply = r;
    return FR_OK;
}

fr_status fr_client_call_locked(fr_client *c, const fr_msg *m, fr_msg_type want, int wait_ms, fr_msg *reply)
{
    ticket *t = calloc(1, sizeof *t);
    if (!t) return fr_fail(FR_ENOMEM, "client: out of memory");
    t->want = want;
    fr_status st = fr_client_send_locked(c, m, t);
    if (st) {
        free(t);
        return st;
    }
    return fr_client_await_locked(c, t, wait_ms, fr_msg_type_name(m->type), reply);
}

/* One call from outside: locks, calls, unlocks. */
static fr_status call(fr_client *c, const fr_msg *m, fr_msg_type want, int wait_ms, fr_msg *reply)
{
    if (!c) return fr_fail(FR_EINVAL, "client: NULL");
    pthread_mutex_lock(&c->mu);
    fr_status st = fr_client_call_locked(c, m, want, wait_ms, reply);
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* The message of each call, and what answers it. A pause in mode wait lasts
 * as long as the samples in flight, so it has no time limit: it ends with
 * its reply, or with the connection. */
static void hello_msg(fr_msg *m, const char *name)
{
    fr_msg_init(m, FR_MSG_HELLO);
    if (name) snprintf(m->u.hello.client, sizeof m->u.hello.client, "%s", name);
}

static int pause_msg(fr_msg *m, fr_pause_mode mode, int recompute)
{
    fr_msg_init(m, FR_MSG_PAUSE);
    m->u.pause.mode = mode;
    m->u.pause.recompute = recompute;
    return mode == FR_PAUSE_WAIT ? -2 : -1;
}

static void resume_msg(fr_msg *m, int recompute)
{
    fr_msg_init(m, FR_MSG_RESUME);
    m->u.resume.recompute = recompute;
}

static fr_status abort_msg(fr_msg *m, const uint64_t *ids, int n)
{
    if (n < 0 || (n > 0 && !ids)) return fr_fail(FR_EINVAL, "client: bad abort arguments");
    fr_msg_init(m, FR_MSG_ABORT);
    m->u.abort.all = n == 0;
    m->u.abort.request_ids = (uint64_t *)ids;
    m->u.abort.n_request_ids = n;
    return FR_OK;
}

/* A call whose reply is a plain struct (no arrays): copied into out (may be
 * NULL), `size` bytes of the reply's union, where every member starts. */
static fr_status struct_call(fr_client *c, const fr_msg *m, fr_msg_type want, int wait_ms, void *out, size_t size)
{
    fr_msg r;
    fr_status st = call(c, m, want, wait_ms, &r);
    if (st) return st;
    if (out) memcpy(out, &r.u, size);
    fr_msg_free(&r);
    return FR_OK;
}

fr_status fr_client_hello(fr_client *c, const char *name, fr_msg_hello_reply *out)
{
    fr_msg m;
    hello_msg(&m, name);
    return struct_call(c, &m, FR_MSG_HELLO_REPLY, -1, out, sizeof *out);
}

fr_status fr_client_stats(fr_client *c, fr_msg_stats_reply *out)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_STATS);
    return struct_call(c, &m, FR_MSG_STATS_REPLY, -1, out, sizeof *out);
}

fr_status fr_client_pause(fr_client *c, fr_pause_mode mode, fr_msg_pause_reply *out)
{
    return fr_client_pause_ex(c, mode, 0, out);
}

fr_status fr_client_pause_ex(fr_client *c, fr_pause_mode mode, int recompute, fr_msg_pause_reply *out)
{
    fr_msg m;
    const int wait = pause_msg(&m, mode, recompute);
    return struct_call(c, &m, FR_MSG_PAUSE_REPLY, wait, out, sizeof *out);
}

fr_status fr_client_resume(fr_client *c, fr_msg_resume_reply *out) { return fr_client_resume_ex(c, 0, out); }

fr_status fr_client_resume_ex(fr_client *c, int recompute, fr_msg_resume_reply *out)
{
    fr_msg m;
    resume_msg(&m, recompute);
    return struct_call(c, &m, FR_MSG_RESUME_REPLY, -1, out, sizeof *out);
}

fr_status fr_client_abort(fr_client *c, const uint64_t *ids, int n, int *samples_ended, int *not_found)
{
    fr_msg m, r;
    fr_status st = abort_msg(&m, ids, n);
    if (!st) st = call(c, &m, FR_MSG_ABORT_REPLY, -1, &r);
    if (st) return st;
    if (samples_ended) *samples_ended = r.u.abort_reply.samples;
    if (not_found) *not_found = r.u.abort_reply.n_not_found;
    fr_msg_free(&r);
    return FR_OK;
}

/* ---- the same as JSON --------------------------------------------------------- */

static fr_status json_call(fr_client *c, const fr_msg *m, fr_msg_type want, int wait_ms, char **json)
{
    if (!json) return fr_fail(FR_EINVAL, "client: NULL");
    fr_msg r;
    fr_status st = call(c, m, want, wait_ms, &r);
    if (st) return st;
    st = fr_msg_to_json(&r, json);
    fr_msg_free(&r);
    return st;
}

fr_status fr_client_hello_json(fr_client *c, const char *name, char **json)
{
    fr_msg m;
    hello_msg(&m, name);
    return json_call(c, &m, FR_MSG_HELLO_REPLY, -1, json);
}

fr_status fr_client_stats_json(fr_client *c, char **json)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_STATS);
    return json_call(c, &m, FR_MSG_STATS_REPLY, -1, json);
}

fr_status fr_client_pause_json(fr_client *c, fr_pause_mode mode, char **json)
{
    return fr_client_pause_ex_json(c, mode, 0, json);
}

fr_status fr_client_pause_ex_json(fr_client *c, fr_pause_mode mode, int recompute, char **json)
{
    fr_msg m;
    const int wait = pause_msg(&m, mode, recompute);
    return json_call(c, &m, FR_MSG_PAUSE_REPLY, wait, json);
}

fr_status fr_client_resume_json(fr_client *c, char **json) { return fr_client_resume_ex_json(c, 0, json); }

fr_status fr_client_resume_ex_json(fr_client *c, int recompute, char **json)
{
    fr_msg m;
    resume_msg(&m, recompute);
    return json_call(c, &m, FR_MSG_RESUME_REPLY, -1, json);
}

fr_status fr_client_abort_json(fr_client *c, const uint64_t *ids, int n, char **json)
{
    fr_msg m;
    fr_status st = abort_msg(&m, ids, n);
    return st ? st : json_call(c, &m, FR_MSG_ABORT_REPLY, -1, json);
}

void fr_client_free_string(char *s) { free(s); }

const char *fr_client_error_text(void) { return fr_last_error(); }

int fr_client_last_error(const fr_client *c, const char **code, const char **message, long long *request_id)
{
    return c ? fr_last_error_peer(code, message, request_id) : 0;
}

/* ---- for the weight updates (client_internal.h) -------------------------------- */

fr_status fr_client_call_(fr_client *c, const fr_msg *m, fr_msg_type want, fr_msg *reply)
{
    return call(c, m, want, -1, reply);
}

fr_status fr_client_send_(fr_client *c, const fr_msg *m)
{
    pthread_mutex_lock(&c->mu);
    fr_status st = fr_client_send_locked(c, m, NULL);
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* Unlinks the first reply no call waits for that is of type want or an
 * error (any type when want is FR_MSG_NONE); NULL when none is. */
static item *take_stray_locked(fr_client *c, fr_msg_type want)
{
    for (item **p = &c->stray_head, *prev = NULL; *p; prev = *p, p = &(*p)->next) {
        item *it = *p;
        if (want != FR_MSG_NONE && it->m.type != want && it->m.type != FR_MSG_ERROR) continue;
        *p = it->next;
        if (c->stray_tail == it) c->stray_tail = prev;
        it->next = NULL;
        return it;
    }
    return NULL;
}

fr_status fr_client_take_(fr_client *c, int wait_ms, fr_msg_type want, const char *what, fr_msg *reply, int *got)
{
    *got = 0;
    pthread_mutex_lock(&c->mu);
    const double until = fr_client_until(wait_ms);
    fr_status st = FR_OK;
    item *it = NULL;
    for (int first = 1; !st && !(it = take_stray_locked(c, want)); first = 0) {
        if (!first && wait_ms >= 0 && fr_now_ms() >= until) break;
        st = fr_client_pump_locked(c, until);
    }
    if (it && it->m.type == FR_MSG_ERROR) {
        char text[160];
        snprintf(text, sizeof text, "server refused %s", what);
        st = fr_client_server_error_(&it->m.u.error, text);
        fr_msg_free(&it->m);
    } else if (it) {
        *reply = it->m;
        *got = 1;
    }
    free(it);
    pthread_mutex_unlock(&c->mu);
    return st;
}

fr_status fr_client_settle_(fr_client *c, int wait_ms)
{
    fr_msg m, r;
    fr_msg_init(&m, FR_MSG_STATS);
    pthread_mutex_lock(&c->mu);
    fr_status st = fr_client_call_locked(c, &m, FR_MSG_STATS_REPLY, wait_ms, &r);
    /* the answers to earlier update and group messages came before it:
     * nobody waits for them */
    item *kept = NULL, **tail = &kept;
    for (item *it; !st && (it = take_stray_locked(c, FR_MSG_NONE));) {
        if (it->m.type == FR_MSG_UPDATE_REPLY || it->m.type == FR_MSG_NCCL_REPLY || it->m.type == FR_MSG_ERROR) {
            fr_msg_free(&it->m);
            free(it);
        } else {
            *tail = it;
            tail = &it->next;
        }
    }
    for (item *it = kept, *next; it; it = next) {   /* anything else goes back, in order */
        next = it->next;
        it->next = NULL;
        if (c->stray_tail) c->stray_tail->next = it;
        else c->stray_head = it;
        c->stray_tail = it;
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

fr_status fr_client_refused_(fr_status st)
{
    const char *code, *msg;
    long long id;
    if (st == FR_EINVAL && fr_last_error_peer(&code, &msg, &id))
        return fr_fail_peer(FR_EINVAL, code, msg, id, "weight update refused by the server: %s: %s", code, msg);
    return st;
}
int fr_client_timeout_(const fr_client *c) { return c->timeout_ms; }
void **fr_client_nccl_slot_(fr_client *c) { return &c->nccl; }

fr_status fr_client_update_begin_(fr_client *c, const char *what)
{
    pthread_mutex_lock(&c->mu);
    const int busy = c->updating;
    c->updating = 1;
    pthread_mutex_unlock(&c->mu);
    if (busy) return fr_fail(FR_EINVAL, "client: %s: another weight update is running on this client", what);
    return FR_OK;
}

void fr_client_update_end_(fr_client *c)
{
    pthread_mutex_lock(&c->mu);
    c->updating = 0;
    pthread_mutex_unlock(&c->mu);
}
