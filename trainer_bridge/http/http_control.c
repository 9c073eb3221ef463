/* The HTTP API's routes beside the generations (docs/http.md): SGLang's
 * control endpoints and OpenAI's /v1/models. Each is a protocol message
 * (pause, resume, abort, hello, stats) or a command of the serve loop
 * (memory, cache) sent on a control slot, answered when its reply comes;
 * /update_weights_from_disk is a thread of its own that feeds the folder's
 * tensors through the protocol's update messages (http_disk.c). */
#include "trainer_bridge/http/http_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Pause modes by name: the protocol's and SGLang's. SGLang's in_place
 * keeps the samples and their KV cache (the protocol's keep); its retract
 * frees their KV cache and recomputes it when they go on (keep with
 * recompute). */
static const struct {
    const char *name;
    fr_pause_mode mode;
    int recompute;
} pause_modes[] = {
    {"abort", FR_PAUSE_ABORT, 0}, {"wait", FR_PAUSE_WAIT, 0},    {"keep", FR_PAUSE_KEEP, 0},
    {"in_place", FR_PAUSE_KEEP, 0}, {"retract", FR_PAUSE_KEEP, 1},
};

static void json_ok(http_call *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void json_ok(http_call *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    c->answer.len = 0;
    fr_buf_vprintf(&c->answer, fmt, ap);
    va_end(ap);
    http_ready(c, 200, "application/json");
}

/* The body as a JSON object (an empty body is {}); NULL after answering 400. */
static cJSON *body_object(http_call *c)
{
    if (c->body.len == 0) return cJSON_CreateObject();
    cJSON *o = cJSON_ParseWithLength(c->body.data, c->body.len);
    if (!o || !cJSON_IsObject(o)) {
        cJSON_Delete(o);
        http_fail(c, 400, "invalid_request_error", "the body must be a JSON object");
        return NULL;
    }
    return o;
}

/* Sends m on a control slot of c's own; the reply answers it. */
static void on_slot(http_call *c, const fr_msg *m)
{
    if (!http_take_slot(c)) {
        http_fail(c, 503, "unavailable", "too many control calls at once (%d); try again", HTTP_CTL_SLOTS);
        return;
    }
    c->waiting = 1;
    if (http_send(c->h, c->slot, 1, m)) {
        c->waiting = 0;
        http_release_slot(c);
        http_fail(c, 503, "unavailable", "%s", fr_last_error());
    }
}

static void command(http_call *c, fr_bridge_cmd_kind kind, int weights)
{
    if (!http_take_slot(c)) {
        http_fail(c, 503, "unavailable", "too many control calls at once (%d); try again", HTTP_CTL_SLOTS);
        return;
    }
    c->waiting = 1;
    const fr_bridge_cmd cmd = {.kind = kind, .weights = weights};
    if (fr_bridge_server_local_command(c->h->srv, c->slot, &cmd)) {
        c->waiting = 0;
        http_release_slot(c);
        http_fail(c, 503, "unavailable", "%s", fr_last_error());
    }
}

/* The body's "recompute" (absent: no); -1 after answering 400. */
static int body_recompute(http_call *c, const cJSON *o)
{
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(o, "recompute");
    if (!r || cJSON_IsNull(r)) return 0;
    if (cJSON_IsBool(r)) return cJSON_IsTrue(r);
    http_fail(c, 400, "invalid_request_error", "recompute: must be true or false");
    return -1;
}

static void route_pause(http_call *c)
{
    cJSON *o = body_object(c);
    if (!o) return;
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(o, "mode");
    const char *name = cJSON_IsString(mode) ? mode->valuestring : "abort";
    int found = -1;
    for (size_t i = 0; i < sizeof pause_modes / sizeof pause_modes[0]; i++)
        if (!strcmp(name, pause_modes[i].name)) found = (int)i;
    const int recompute = body_recompute(c, o);
    if (recompute < 0) {
        cJSON_Delete(o);
        return;
    }
    if (mode && !cJSON_IsNull(mode) && !cJSON_IsString(mode)) {
        http_fail(c, 400, "invalid_request_error", "mode: must be a string (abort, wait, keep, in_place or retract)");
    } else if (found < 0) {
        http_fail(c, 400, "invalid_request_error",
                  "mode: \"%s\" is not a pause mode (abort, wait, keep, in_place, retract)", name);
    } else if (recompute && pause_modes[found].mode != FR_PAUSE_KEEP) {
        http_fail(c, 400, "invalid_request_error", "recompute: only with mode keep (or in_place)");
    } else {
        fr_msg m;
        fr_msg_init(&m, FR_MSG_PAUSE);
        m.u.pause.mode = pause_modes[found].mode;
        m.u.pause.recompute = recompute || pause_modes[found].recompute;
        on_slot(c, &m);
    }
    cJSON_Delete(o);
}

/* Frozen samples go on; with "recompute", over a KV cache recomputed with
 * the weights serving now. */
static void route_continue(http_call *c)
{
    cJSON *o = body_object(c);
    if (!o) return;
    const int recompute = body_recompute(c, o);
    if (recompute >= 0) {
        fr_msg m;
        fr_msg_init(&m, FR_MSG_RESUME);
        m.u.resume.recompute = recompute;
        on_slot(c, &m);
    }
    cJSON_Delete(o);
}

static void route_abort(http_call *c)
{
    cJSON *o = body_object(c);
    if (!o) return;
    const cJSON *rid = cJSON_GetObjectItemCaseSensitive(o, "rid"), *all = cJSON_GetObjectItemCaseSensitive(o, "abort_all");
    if (cJSON_IsTrue(all)) {
        c->waiting = 1;
        http_send_abort(c->h, c, NULL, 0);
    } else if (!cJSON_IsString(rid)) {
        http_fail(c, 400, "invalid_request_error", "rid: a string is required (or abort_all: true)");
    } else {
        uint64_t *ids = NULL;
        int n = 0, cap = 0;
        for (http_call *x = c->h->calls; x; x = x->next)
            for (int p = 0; x->gen_ok && x->req_open && p < x->gen.n_prompts; p++)
                if (x->req_open[p] && x->gen.rid[p] && !strcmp(x->gen.rid[p], rid->valuestring)) {
                    if (n == cap) {
                        cap = cap ? 2 * cap : 16;
                        uint64_t *v = realloc(ids, sizeof *v * (size_t)cap);
                        if (!v) break;
                        ids = v;
                    }
                    ids[n++] = x->req_id[p];
                }
        if (n == 0) {
            json_ok(c, "{\"success\":true,\"aborted_samples\":0,\"message\":\"no open request has this rid\"}");
        } else {
            c->waiting = 1;
            http_send_abort(c->h, c, ids, n);
        }
        free(ids);
    }
    cJSON_Delete(o);
}

static void route_release(http_call *c)
{
    cJSON *o = body_object(c);
    if (!o) return;
    const cJSON *tags = cJSON_GetObjectItemCaseSensitive(o, "tags");
    int weights = 1, bad = 0;   /* no tags: everything */
    if (cJSON_IsArray(tags)) {
        weights = 0;
        for (const cJSON *t = tags->child; t; t = t->next) {
            if (cJSON_IsString(t) && !strcmp(t->valuestring, "weights")) weights = 1;
            else if (!cJSON_IsString(t) || (strcmp(t->valuestring, "kv_cache") && strcmp(t->valuestring, "cuda_graph")))
                bad = 1;
        }
    } else if (tags && !cJSON_IsNull(tags)) {
        bad = 1;
    }
    if (bad) http_fail(c, 400, "invalid_request_error", "tags: a list of \"kv_cache\", \"weights\", \"cuda_graph\"");
    else command(c, FR_BRIDGE_CMD_RELEASE_MEMORY, weights);
    cJSON_Delete(o);
}

static void route_models(http_call *c)
{
    c->answer.len = 0;
    fr_buf_printf(&c->answer, "{\"object\":\"list\",\"data\":[{\"id\":");
    http_json_str(&c->answer, c->h->model_name, strlen(c->h->model_name));
    fr_buf_printf(&c->answer, ",\"object\":\"model\",\"created\":%ld,\"owned_by\":\"fp4rollout\",\"root\":",
                  (long)time(NULL));
    http_json_str(&c->answer, c->h->model_name, strlen(c->h->model_name));
    fr_buf_printf(&c->answer, "}]}");
    http_ready(c, 200, "application/json");
}

/* A one-token greedy generation through the engine, as SGLang's. */
static void route_health_generate(http_call *c)
{
    fr_http *h = c->h;
    http_gen *g = &c->gen;
    memset(g, 0, sizeof *g);
    g->api = API_SGLANG;
    g->n = 1;
    g->n_prompts = 1;
    g->prompt = calloc(1, sizeof *g->prompt);
    g->n_prompt = calloc(1, sizeof *g->n_prompt);
    g->prompt_text = calloc(1, sizeof *g->prompt_text);
    g->rid = calloc(1, sizeof *g->rid);
    if (g->prompt) g->prompt[0] = malloc(sizeof(int));
    if (!g->prompt || !g->n_prompt || !g->prompt_text || !g->rid || !g->prompt[0]) {
        http_fail(c, 503, "unavailable", "out of memory");
        return;
    }
    g->prompt[0][0] = h->n_eos ? h->eos[0] : 0;
    g->n_prompt[0] = 1;
    g->g.monitor_divergence = 0;
    g->g.has_max_tokens = g->g.has_temperature = 1;
    g->g.max_tokens = 1;
    c->gen_ok = 1;
    c->health = 1;
    http_start_generation(c);
}

int http_control_route(http_call *c)
{
    const char *u = c->url;
    if (!strcmp(u, "/v1/models") || !strcmp(u, "/get_model_info") || !strcmp(u, "/get_server_info") ||
        !strcmp(u, "/health_generate")) {
        fr_msg m;
        if (!strcmp(u, "/v1/models")) route_models(c);
        else if (!strcmp(u, "/health_generate")) route_health_generate(c);
        else {
            fr_msg_init(&m, !strcmp(u, "/get_model_info") ? FR_MSG_HELLO : FR_MSG_STATS);
            on_slot(c, &m);
        }
        return 1;
    }
    static const char *const posts[] = {"/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
                                        "/release_memory_occupation", "/resume_memory_occupation",
                                        "/update_weights_from_disk", NULL};
    int post = 0;
    for (int i = 0; posts[i]; i++) post |= !strcmp(u, posts[i]);
    if (!post) return 0;
    if (!c->post) {
        http_fail(c, 405, "invalid_request_error", "%s takes POST", u);
        return 1;
    }
    if (!strcmp(u, "/abort_request")) route_abort(c);
    else if (!strcmp(u, "/pause_generation")) route_pause(c);
    else if (!strcmp(u, "/continue_generation")) route_continue(c);
    else if (!strcmp(u, "/flush_cache")) command(c, FR_BRIDGE_CMD_FLUSH_CACHE, 0);
    else if (!strcmp(u, "/release_memory_occupation")) route_release(c);
    else if (!strcmp(u, "/resume_memory_occupation")) command(c, FR_BRIDGE_CMD_RESUME_MEMORY, 0);
    else http_disk_start(c);
    return 1;
}

/* ---- replies ---------------------------------------------------------------------- */

static void model_info(http_call *c, const fr_msg_hello_reply *r)
{
    fr_http *h = c->h;
    fr_buf *b = &c->answer;
    b->len = 0;
    fr_buf_printf(b, "{\"model_path\":");
    http_json_str(b, r->model, strlen(r->model));
    fr_buf_printf(b, ",\"tokenizer_path\":");
    if (h->tok && h->tok_name[0]) http_json_str(b, h->tok_name, strlen(h->tok_name));
    else fr_buf_printf(b, "null");
    fr_buf_printf(b, ",\"is_generation\":true,\"preferred_sampling_params\":null,\"weight_version\":\"%llu\","
                     "\"backend\":\"%s\",\"kv_dtype\":\"%s\",\"tp\":%d,\"engines\":%d,\"max_seqs\":%d,"
                     "\"max_model_len\":%d,\"vocab_size\":%d,\"text\":%s,\"eos_token_ids\":[",
                  (unsigned long long)r->weight_version, r->backend, r->kv_dtype, r->tp, r->engines, r->max_seqs,
                  r->max_model_len, r->vocab_size, h->tok ? "true" : "false");
    for (int i = 0; i < r->n_eos_token_ids; i++) fr_buf_printf(b, "%s%d", i ? "," : "", r->eos_token_ids[i]);
    fr_buf_printf(b, "],\"kv_blocks\":%d,\"kv_block_tokens\":%d,\"max_total_num_tokens\":%lld}", r->kv_blocks,
                  r->kv_block_tokens, (long long)r->kv_blocks * r->kv_block_tokens);
    http_ready(c, 200, "application/json");
}

static void server_info(http_call *c, const fr_msg_stats_reply *r)
{
    fr_buf *b = &c->answer;
    b->len = 0;
    fr_buf_printf(b, "{\"version\":\"fp4rollout\",\"model_path\":");
    http_json_str(b, c->h->model_name, strlen(c->h->model_name));
    fr_buf_printf(b, ",\"state\":\"%s\",\"weight_version\":\"%llu\",\"scheduler\":{\"running\":%d,\"prefilling\":%d,"
                     "\"waiting\":%d,\"preemptions\":%llu,\"tokens_generated\":%llu,\"prefill_tokens\":%llu,"
                     "\"steps\":%llu,\"finished\":%llu,\"kv_blocks_used\":%d,\"kv_blocks_free\":%d},\"server\":{"
                     "\"open_requests\":%d,\"held_requests\":%d,\"requests_accepted\":%llu,\"requests_rejected\":%llu,"
                     "\"samples_done\":%llu,\"tokens_streamed\":%llu,\"updating\":%s,\"updates_committed\":%llu,"
                     "\"updates_failed\":%llu,\"clients\":%d}}",
                  r->state, (unsigned long long)r->weight_version, r->running, r->prefilling, r->waiting,
                  (unsigned long long)r->preemptions, (unsigned long long)r->tokens_generated,
                  (unsigned long long)r->prefill_tokens, (unsigned long long)r->steps,
                  (unsigned long long)r->finished, r->kv_blocks_used, r->kv_blocks_free, r->open_requests,
                  r->held_requests, (unsigned long long)r->requests_accepted,
                  (unsigned long long)r->requests_rejected, (unsigned long long)r->samples_done,
                  (unsigned long long)r->tokens_streamed, r->updating ? "true" : "false",
                  (unsigned long long)r->updates_committed, (unsigned long long)r->updates_failed, r->clients);
    http_ready(c, 200, "application/json");
}

/* A command's code as an HTTP status. */
static unsigned command_status(const char *code)
{
    if (!strcmp(code, "ok")) return 200;
    if (!strcmp(code, "busy")) return 400;
    if (!strcmp(code, "unsupported")) return 501;
    return 500;
}

void http_control_reply(http_call *c)
{
    if (c->worker) {   /* the disk update's thread reads it */
        pthread_cond_broadcast(&c->cv);
        return;
    }
    const fr_msg *m = (const fr_msg *)(uintptr_t)c->u[3];
    http_release_slot(c);
    if (c->got == FR_MSG_ERROR) {
        const int conflict = !strcmp(c->code, "pause_cancelled") || !strcmp(c->code, "forbidden");
        http_fail(c, conflict ? 409 : 503, c->code, "%s", c->message);
    } else if (c->got == FR_MSG_HELLO_REPLY && m) {
        model_info(c, &m->u.hello_reply);
    } else if (c->got == FR_MSG_STATS_REPLY && m) {
        server_info(c, &m->u.stats_reply);
    } else if (c->got == FR_MSG_PAUSE_REPLY) {
        json_ok(c, "{\"success\":true,\"state\":\"paused\",\"aborted_samples\":%llu}", (unsigned long long)c->u[0]);
    } else if (c->got == FR_MSG_RESUME_REPLY) {
        json_ok(c, "{\"success\":true,\"state\":\"running\",\"released_requests\":%llu}", (unsigned long long)c->u[0]);
    } else if (c->got == FR_MSG_ABORT_REPLY) {
        json_ok(c, "{\"success\":true,\"aborted_samples\":%llu}", (unsigned long long)c->u[0]);
    } else if (c->got == FR_MSG_NONE) {   /* a command's answer */
        const unsigned status = command_status(c->code);
        c->answer.len = 0;
        fr_buf_printf(&c->answer, "{\"success\":%s,\"message\":", status == 200 ? "true" : "false");
        http_json_str(&c->answer, c->message, strlen(c->message));
        fr_buf_printf(&c->answer, "}");
        http_ready(c, status, "application/json");
    } else {
        http_fail(c, 500, "server_error", "an unexpected reply (%s)", fr_msg_type_name(c->got));
    }
}
