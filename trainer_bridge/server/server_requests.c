/* The engines (one, or several over the ranks) and the requests that come
 * in: generate, abort, stats, hello (docs/protocol.md); pause and resume
 * are server_pause.c's. */
#include "trainer_bridge/server/server_internal.h"

static const char *const state_names[] = {"running", "pausing", "paused"};

/* ---- the engines ----------------------------------------------------------- */

/* With one process these act on the scheduler at once. With several ranks
 * rank 0 records them as events, which every rank applies to its own
 * scheduler at the start of the next step (apply_events); their results
 * come back as records after it (take_results). */

static void put_spec(fr_rank_buf *b, int engine, const fr_request_spec *r)
{
    fr_rank_put_u8(b, EV_SUBMIT);
    fr_rank_put_i32(b, engine);
    fr_rank_put_u64(b, r->id);
    fr_rank_put_u64(b, r->group);
    fr_rank_put_i32s(b, r->prompt, r->n_prompt);
    fr_rank_put_i32(b, r->n);
    fr_rank_put_i32(b, r->first_sample);
    fr_rank_put_f32(b, r->params.temperature);
    fr_rank_put_i32(b, r->params.top_k);
    fr_rank_put_f32(b, r->params.top_p);
    fr_rank_put_u64(b, r->params.seed);
    fr_rank_put_i32(b, r->max_tokens);
    fr_rank_put_i32s(b, r->stop_ids, r->n_stop > 0 ? r->n_stop : 0);
    fr_rank_put_i32(b, r->monitor);
    fr_rank_put_i32(b, r->per_token_kl);
    fr_rank_put_i32(b, r->min_tokens);
    fr_rank_put_i32(b, r->top_logprobs);
    fr_rank_put_i32(b, r->prompt_logprobs);
    fr_rank_put_i32(b, r->return_routed_experts);
    fr_rank_put_f32(b, r->penalties.min_p);
    fr_rank_put_f32(b, r->penalties.presence_penalty);
    fr_rank_put_f32(b, r->penalties.frequency_penalty);
    fr_rank_put_f32(b, r->penalties.repetition_penalty);
    fr_rank_put_i32(b, r->forced ? 1 : 0);
    if (r->forced) fr_rank_put_i32s(b, r->forced, r->n_forced);
    fr_rank_put_i32s(b, r->continue_tokens, r->n_continue);
    srv_put_text_spec(b, r);
}

/* Open samples of the requests the engines run (held ones excluded). */
int srv_engine_samples(const fr_bridge_server *srv)
{
    int n = 0;
    for (int i = 0; i < srv->n_reqs; i++)
        if (!srv->reqs[i]->held) n += srv->reqs[i]->open;
    return n;
}

/* Starts q on an engine: with several, the one with the fewest open
 * samples (ties: turn by turn). */
fr_status srv_eng_submit(fr_bridge_server *srv, request *q, const fr_request_spec *spec)
{
    if (srv->released)
        return fr_fail(FR_EUNSUPPORTED, "request %llu: the engine's memory is released (release_memory_occupation); "
                                 "resume it first", (unsigned long long)q->request_id);
    if (!srv->multi) return fr_scheduler_submit(srv->sch, spec);
    int best = -1;
    for (int k = 0; k < srv->n_engines; k++) {
        int e = (srv->next_engine + k) % srv->n_engines;
        if (best < 0 || srv->engine_open[e] < srv->engine_open[best]) best = e;
    }
    srv->next_engine = (best + 1) % srv->n_engines;
    put_spec(&srv->events, best, spec);
    if (srv->events.failed) return fr_fail(FR_ENOMEM, "the server is out of memory");
    q->engine = best;
    srv->engine_open[best] += q->n;
    return FR_OK;
}

/* Ends q's samples on its engine; *n gets how many. */
static fr_status eng_abort(fr_bridge_server *srv, const request *q, int *n)
{
    if (!srv->multi) return fr_scheduler_abort(srv->sch, q->sid, n);
    fr_rank_put_u8(&srv->events, EV_ABORT);
    fr_rank_put_i32(&srv->events, q->engine);
    fr_rank_put_u64(&srv->events, q->sid);
    *n = q->open;
    return srv->events.failed ? fr_fail(FR_ENOMEM, "the server is out of memory") : FR_OK;
}

fr_status srv_eng_abort_all(fr_bridge_server *srv, int *n)
{
    if (!srv->multi) return fr_scheduler_abort_all(srv->sch, n);
    fr_rank_put_u8(&srv->events, EV_ABORT_ALL);
    *n = srv_engine_samples(srv);
    return srv->events.failed ? fr_fail(FR_ENOMEM, "the server is out of memory") : FR_OK;
}

/* ---- requests in ----------------------------------------------------------- */

/* The engine request of a generate, with the server's defaults for what it
 * leaves out (prompt and stop ids point into g, q or the server). */
static void build_spec(const fr_bridge_server *srv, const request *q, const fr_msg_generate *g, fr_request_spec *r)
{
    const fr_bridge_sampling *d = &srv->cfg.sampling;
    memset(r, 0, sizeof *r);
    r->id = q->sid;
    r->group = q->group_id;
    r->report_id = q->request_id;   /* the metrics name the trainer's id */
    r->has_report_id = 1;
    r->prompt = q->prompt_ids ? q->prompt_ids : g->prompt;
    r->n_prompt = q->n_prompt;
    r->n = g->n;
    r->first_sample = q->first_sample;
    r->params = d->params;
    if (g->has_temperature) r->params.temperature = (float)g->temperature;
    if (g->has_top_k) r->params.top_k = g->top_k;
    if (g->has_top_p) r->params.top_p = (float)g->top_p;
    r->params.seed = q->seed;
    r->max_tokens = g->has_max_tokens ? g->max_tokens : d->max_tokens;
    if (g->has_stop_token_ids) {
        r->stop_ids = g->stop_token_ids;
        r->n_stop = g->n_stop_token_ids;
    } else {
        r->stop_ids = srv->default_stop;
        r->n_stop = srv->n_default_stop;
    }
    r->monitor = g->monitor_divergence;   /* -1 when absent: the scheduler's kl_sample_rate */
    r->per_token_kl = g->per_token_kl;
    r->min_tokens = g->min_tokens;
    r->top_logprobs = g->logprobs;
    r->prompt_logprobs = g->prompt_logprobs;
    r->return_routed_experts = g->return_routed_experts;
    r->penalties = (fr_penalties){.min_p = (float)g->min_p, .presence_penalty = (float)g->presence_penalty,
                                  .frequency_penalty = (float)g->frequency_penalty,
                                  .repetition_penalty = (float)g->repetition_penalty};
    r->forced = g->forced_tokens;
    r->n_forced = g->forced_tokens ? g->n_forced_tokens : 0;
    r->continue_tokens = g->continue_tokens;
    r->n_continue = g->continue_tokens ? g->n_continue_tokens : 0;
    srv_text_spec(q, r);
}

/* The checks fr_scheduler_submit makes, so a request held during a pause
 * is refused at once rather than after the resume. */
fr_status srv_check_spec(const fr_bridge_server *srv, const fr_request_spec *r, uint64_t caller_id)
{
    fr_request_spec named = *r;   /* messages name the client's request id, not the server's own */
    named.id = caller_id;
    fr_status st = fr_request_spec_check(&named, srv->vocab);
    if (st) return st;
    /* the engine refuses it too, but naming its own id, and on other ranks only after the answer */
    if (r->return_routed_experts && !srv->moe_layers)
        return fr_fail(FR_EINVAL, "request %llu: return_routed_experts: the model has no mixture-of-experts layer",
                       (unsigned long long)caller_id);
    if (r->n_prompt >= srv->max_pos)
        return fr_fail(FR_EINVAL, "request %llu: the prompt (%d tokens) does not fit the context window of %d",
                       (unsigned long long)caller_id, r->n_prompt, srv->max_pos);
    int mt = r->max_tokens < srv->max_pos - r->n_prompt ? r->max_tokens : srv->max_pos - r->n_prompt;
    int blocks = (r->n_prompt + mt + FR_PAGE_TOKENS - 1) / FR_PAGE_TOKENS;
    if (blocks > srv->n_blocks)
        return fr_fail(FR_EINVAL, "request %llu: prompt (%d) + max_tokens (%d) needs %d KV blocks, the cache has %d",
                       (unsigned long long)caller_id, r->n_prompt, mt, blocks, srv->n_blocks);
    if (r->n_continue >= mt)
        return fr_fail(FR_EINVAL, "request %llu: the prompt (%d tokens) and %d continued tokens leave nothing to "
                                  "generate in the context window of %d",
                       (unsigned long long)caller_id, r->n_prompt, r->n_continue, srv->max_pos);
    return FR_OK;
}

/* A max_tokens the request asks for must fit the context window: cutting it
 * short would hand the trainer samples shorter than it asked for with no
 * word of why. Left out, the server's default applies, cut to the window
 * (docs/protocol.md, generate). */
static fr_status check_window(const fr_bridge_server *srv, const fr_msg_generate *g, int n_prompt)
{
    if (!g->has_max_tokens || n_prompt >= srv->max_pos || g->max_tokens <= srv->max_pos - n_prompt)
        return FR_OK;
    return fr_fail(FR_EINVAL, "request %llu: max_tokens %d does not fit the context window: prompt (%d tokens) + "
                              "max_tokens must be at most max_model_len %d, so max_tokens is at most %d here "
                              "(left out, the most that fits applies)",
                   (unsigned long long)g->request_id, g->max_tokens, n_prompt, srv->max_pos,
                   srv->max_pos - n_prompt);
}

static int insert_request(fr_bridge_server *srv, request *q)
{
    if (srv->n_reqs == srv->cap_reqs) {
        int c = srv->cap_reqs ? srv->cap_reqs * 2 : 64;
        request **v = realloc(srv->reqs, sizeof *v * (size_t)c);
        if (!v) return -1;
        srv->reqs = v;
        srv->cap_reqs = c;
    }
    srv->reqs[srv->n_reqs++] = q;   /* sids increase: the order holds */
    return 0;
}

/* A copy of n ids (NULL for none); *ok 0 when out of memory. */
static int *copy_ids(const int *ids, int n, int *ok)
{
    if (!ids || n <= 0) return NULL;
    int *c = malloc(sizeof(int) * (size_t)n);
    if (!c) *ok = 0;
    else memcpy(c, ids, sizeof(int) * (size_t)n);
    return c;
}

/* A request held by a pause keeps its spec, with copies of the arrays the
 * message owned; -1 when out of memory (nothing kept). */
static int keep_held(request *q, fr_request_spec *spec)
{
    int ok = 1;
    int *p = copy_ids(spec->prompt, spec->n_prompt, &ok);
    int *s = copy_ids(spec->stop_ids, spec->n_stop, &ok);
    int *f = copy_ids(spec->forced, spec->n_forced, &ok);
    int *c = copy_ids(spec->continue_tokens, spec->n_continue, &ok);
    if (!ok) {
        free(p);
        free(s);
        free(f);
        free(c);
        return -1;
    }
    spec->prompt = p;
    spec->stop_ids = s;
    spec->forced = f;
    spec->continue_tokens = c;
    q->spec = *spec;
    q->held = 1;
    return 0;
}

void srv_handle_generate(fr_bridge_server *srv, int peer, const fr_msg_generate *g)
{
    uint64_t id = g->request_id;
    if (srv->stopping) {   /* read after the last turn: nothing will run it */
        srv->requests_rejected++;
        srv_send_error(srv, peer, "shutdown", 1, id, "request %llu: the server is shutting down",
                       (unsigned long long)id);
        return;
    }
    if (srv->released) {
        srv->requests_rejected++;
        srv_send_error(srv, peer, "memory_released", 1, id,
                       "request %llu: the engine's memory is released (release_memory_occupation); resume it first",
                       (unsigned long long)id);
        return;
    }
    if (srv_find_caller(srv, peer, id)) {
        srv->requests_rejected++;
        srv_send_error(srv, peer, "duplicate_request_id", 1, id,
                   "request_id %llu is already open for this client; ids must be unique among open requests",
                   (unsigned long long)id);
        return;
    }
    request *q = calloc(1, sizeof *q);
    if (q) q->s = calloc((size_t)g->n, sizeof(sample_state));
    if (!q || !q->s) {
        free(q);
        srv->requests_rejected++;
        srv_send_error(srv, peer, "out_of_memory", 1, id, "the server is out of memory");
        return;
    }
    q->sid = ++srv->next_sid;
    q->request_id = id;
    q->group_id = g->has_group_id ? g->group_id : id;
    q->peer = peer;
    q->n = q->open = g->n;
    q->first_sample = g->first_sample;
    q->start = g->continue_tokens ? g->n_continue_tokens : 0;
    q->n_prompt = g->n_prompt;
    q->t0_ms = fr_now_ms();
    q->seed = g->has_seed ? g->seed : fr_seed_stream_next(&srv->seeds);
    fr_request_spec spec;
    fr_status st = srv_text_request(srv, q, g);   /* prompt_text encoded, stop strings kept */
    build_spec(srv, q, g, &spec);
    if (!st) st = srv_check_spec(srv, &spec, id);
    if (!st) st = check_window(srv, g, q->n_prompt);
    if (!st && insert_request(srv, q)) st = fr_fail(FR_ENOMEM, "the server is out of memory");
    if (st) {
        srv_free_request(q);
        srv->requests_rejected++;
        srv_send_error(srv, peer, st == FR_ENOMEM ? "out_of_memory" : "invalid_request", 1, id, "%s", fr_last_error());
        return;
    }
    if (srv->state != RUNNING) {   /* held until resume */
        if (keep_held(q, &spec)) {
            srv_remove_request(srv, q);
            srv->requests_rejected++;
            srv_send_error(srv, peer, "out_of_memory", 1, id, "the server is out of memory");
            return;
        }
        srv->requests_accepted++;
        return;
    }
    if ((st = srv_eng_submit(srv, q, &spec))) {
        char msg[FR_PROTO_TEXT_MAX];
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        srv_remove_request(srv, q);
        srv->requests_rejected++;
        srv_send_error(srv, peer, srv->released ? "memory_released" : "invalid_request", 1, id, "%s", msg);
        return;
    }
    srv->requests_accepted++;
}

/* Ends every sample of a held request with reason abort. */
int srv_abort_held(fr_bridge_server *srv, request *q)
{
    int n = q->open, total = q->n;
    srv->held_aborted += (uint64_t)n;
    for (int k = 0; k < total; k++) srv_send_done(srv, q, k, FR_WIRE_ABORT, 0, 0, NULL, NULL);   /* the last frees q */
    return n;
}

/* Ends the request with scheduler id sid; returns the samples ended. */
int srv_abort_sid(fr_bridge_server *srv, uint64_t sid)
{
    request *q = srv_find_sid(srv, sid);
    if (!q) return 0;
    if (q->held) return srv_abort_held(srv, q);
    int n = 0;
    if (eng_abort(srv, q, &n)) srv_log(srv, "abort: %s", fr_last_error());
    return n;
}

/* The scheduler ids of the peer's open requests (every peer's when peer < 0). */
uint64_t *srv_sids_of(const fr_bridge_server *srv, int peer, int *n)
{
    uint64_t *v = malloc(sizeof(uint64_t) * (size_t)(srv->n_reqs ? srv->n_reqs : 1));
    *n = 0;
    if (!v) return NULL;
    for (int i = 0; i < srv->n_reqs; i++)
        if (peer < 0 || srv->reqs[i]->peer == peer) v[(*n)++] = srv->reqs[i]->sid;
    return v;
}

void srv_handle_abort(fr_bridge_server *srv, int peer, const fr_msg_abort *a)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_ABORT_REPLY);
    int ended = 0;
    uint64_t *missing = NULL;
    int n_missing = 0;
    if (a->all) {
        int n;
        uint64_t *sids = srv_sids_of(srv, peer, &n);
        if (!sids) {
            srv_send_error(srv, peer, "out_of_memory", 0, 0, "the server is out of memory");
            return;
        }
        for (int i = 0; i < n; i++) ended += srv_abort_sid(srv, sids[i]);
        free(sids);
    } else {
        missing = malloc(sizeof(uint64_t) * (size_t)a->n_request_ids);
        if (!missing) {
            srv_send_error(srv, peer, "out_of_memory", 0, 0, "the server is out of memory");
            return;
        }
        for (int i = 0; i < a->n_request_ids; i++) {
            request *q = srv_find_caller(srv, peer, a->request_ids[i]);
            if (!q) missing[n_missing++] = a->request_ids[i];
            else ended += srv_abort_sid(srv, q->sid);
        }
    }
    srv_flush_all(srv);
    m.u.abort_reply.samples = ended;
    m.u.abort_reply.not_found = missing;
    m.u.abort_reply.n_not_found = n_missing;
    srv_send_later(srv, peer, &m);
    free(missing);
}

void srv_handle_stats(fr_bridge_server *srv, int peer)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_STATS_REPLY);
    fr_msg_stats_reply *r = &m.u.stats_reply;
    fr_scheduler_stats ss;
    if (srv->multi) ss = srv->agg;   /* every engine's, summed, as of the last step */
    else fr_scheduler_stats_get(srv->sch, &ss);
    fr_peers_stats ps;
    fr_peers_stats_get(srv->peers, &ps);
    r->running = ss.running;
    r->prefilling = ss.prefilling;
    r->waiting = ss.waiting;
    r->preemptions = (uint64_t)ss.preemptions;
    r->tokens_generated = (uint64_t)ss.tokens_generated;
    r->prefill_tokens = (uint64_t)ss.prefill_tokens;
    r->steps = (uint64_t)ss.steps;
    r->finished = (uint64_t)ss.finished + srv->held_aborted;   /* held samples never reached the engine */
    r->kv_blocks_used = ss.kv_blocks_used;
    r->kv_blocks_free = ss.kv_blocks_free;
    snprintf(r->state, sizeof r->state, "%s", state_names[srv->state]);
    r->weight_version = srv->weight_version;
    r->clients = fr_peers_count(srv->peers);
    r->open_requests = srv->n_reqs;
    for (int i = 0; i < srv->n_reqs; i++) r->held_requests += srv->reqs[i]->held;
    r->messages_in = srv->messages_in;
    r->messages_out = srv->messages_out + 1;   /* this reply included */
    r->bad_messages = srv->bad_messages;
    r->errors_sent = srv->errors_sent;
    r->requests_accepted = srv->requests_accepted;
    r->requests_rejected = srv->requests_rejected;
    r->samples_done = srv->samples_done;
    r->tokens_streamed = srv->tokens_streamed;
    r->send_retries = ps.retries;
    r->queued_messages = ps.queued;
    r->undeliverable_messages = ps.undeliverable;
    r->clients_departed = srv->clients_departed;
    r->updating = srv->upd != NULL;
    r->update_version = srv->upd ? fr_weight_update_version(srv->upd) : 0;
    r->updates_committed = srv->updates_committed;
    r->updates_failed = srv->updates_failed;
    srv_send_msg(srv, peer, &m);
}

void srv_handle_hello(fr_bridge_server *srv, int peer)
{
    fr_msg m;
    fr_msg_init(&m, FR_MSG_HELLO_REPLY);
    fr_msg_hello_reply *h = &m.u.hello_reply;
    const fr_model_config *mc = &srv->sess->model->cfg;
    snprintf(h->server, sizeof h->server, "fp4rollout");
    snprintf(h->model, sizeof h->model, "%s", srv->cfg.model_name ? srv->cfg.model_name : "unknown");
    snprintf(h->backend, sizeof h->backend, "%s", fr_backend_name(srv->sess->backend));
    snprintf(h->kv_dtype, sizeof h->kv_dtype, "%s", fr_kv_dtype_name(fr_kv_cache_config_of(srv->sess->kv)->dtype));
    h->tp = srv->multi ? srv->tp : srv->sess->tp.size > 0 ? srv->sess->tp.size : 1;
    h->engines = srv->multi ? srv->n_engines : 1;
    h->weight_version = srv->weight_version;
    h->max_seqs = srv->max_seqs;
    h->kv_blocks = srv->n_blocks;
    h->kv_block_tokens = FR_PAGE_TOKENS;
    h->max_model_len = srv->max_pos;
    h->vocab_size = srv->vocab;
    h->n_eos_token_ids = mc->n_eos < FR_PROTO_MAX_EOS ? mc->n_eos : FR_PROTO_MAX_EOS;
    for (int i = 0; i < h->n_eos_token_ids; i++) h->eos_token_ids[i] = mc->eos_ids[i];
    h->chunk = srv->chunk;
    if (srv->cfg.tokenizer)
        snprintf(h->tokenizer, sizeof h->tokenizer, "%s", srv->cfg.tokenizer_name ? srv->cfg.tokenizer_name : "yes");
    srv_send_msg(srv, peer, &m);
}
