/* What the files of the HTTP API (trainer_bridge/http/http.h) share:
 * parsed requests, text in and out, the calls and their samples, and the
 * http_ functions one concern calls in another. Private to
 * trainer_bridge/http/. */
#ifndef FR_HTTP_INTERNAL_H
#define FR_HTTP_INTERNAL_H

#include "trainer_bridge/http/http.h"

#include <pthread.h>
#include <stdint.h>

#include "base/buf.h"
#include "trainer_bridge/protocol/protocol.h"

/* Text in and out is the server's (fr_bridge_server_tokenizer): text
 * prompts are encoded with it here (fr_bridge_encode_prompt, as the server
 * encodes prompt_text), stop strings and the samples' text are the
 * engine's (the protocol's stop, return_text; docs/protocol.md, "Text"). */

/* ---- parsed requests (http_parse.c) --------------------------------------- */

enum { API_SGLANG = 1, API_OPENAI = 2 };

#define HTTP_ID_MAX 128

typedef struct {
    int api;
    int batch;                  /* the prompt was a list: the answer is a list */
    int n_prompts;
    int **prompt;               /* [n_prompts][n_prompt[i]] token ids (owned) */
    int *n_prompt;
    char **prompt_text;         /* text prompts as given (owned; NULL entries for ids), for echo */
    int text_in;                /* the prompts came as text */
    int n;                      /* samples per prompt */
    fr_msg_generate g;          /* the sampling keys and stop strings (owned; prompt, n, request_id and
                                   return_text are set per request) */
    int ignore_eos;
    int return_logprob;         /* SGLang: output_token_logprobs (and input ones from logprob_start_len) */
    int top_logprobs_num;       /* SGLang top log-probs per token; OpenAI logprobs k */
    int logprob_start_len;      /* < 0: no prompt log-probs */
    int openai_logprobs;        /* OpenAI: logprobs asked (k may be 0) */
    int echo;
    int stream;
    int include_usage;
    char **rid;                 /* SGLang rid per prompt (owned; NULL entries: none given) */
    char model[256];
} http_gen;

/* Reads a body into out (cleared first); FR_EINVAL with a message naming
 * the field that is wrong. tok: the server's tokenizer, for text prompts
 * (NULL: text refused). */
fr_status http_parse_generate(const char *body, size_t len, const fr_tokenizer *tok, http_gen *out);
fr_status http_parse_completions(const char *body, size_t len, const fr_tokenizer *tok, http_gen *out);
void http_gen_free(http_gen *g);

/* ---- results and answers (http_answer.c) ----------------------------------- */

/* One sample as the calls see it. */
typedef struct {
    int *tok;                   /* [n] each: views of the buffers below */
    float *lp;
    uint64_t *wv;
    int n;
    fr_buf tokb, lpb, wvb;      /* what the deltas brought, appended (http_sample_append) */
    fr_buf text;                /* the engine's text so far: its deltas', then its done's whole text */
    size_t text_sent;           /* bytes streamed (OpenAI deltas) */
    int tok_sent;               /* tokens streamed */
    int final_sent;             /* its last stream chunk went out */
    int dirty;                  /* changed since its last stream chunk */
    int ended;                  /* its done came (or its generate was refused) */
    fr_wire_finish finish;
    char *matched;              /* the stop string that ended it (the done's stop_str) */
    char why[256];              /* abort or error: what happened */
    int *top_ids;               /* from its done: [n * top_k] */
    float *top_lps;
    int top_k;
    float *plp;                 /* the prompt's log-probs (shared by the prompt's samples: owned by sample 0) */
    int n_plp;
    int has_seed;
    uint64_t seed;
    int sample;
    double total_ms;            /* from the server receiving the request to the sample's done */
    fr_msg_divergence div;      /* summary only (kl NULL) */
    uint8_t *routes;            /* from its done: routed experts, [n][layers][k] ids of route_width bytes */
    int route_layers, route_k, route_width;
} http_sample;

void http_sample_free(http_sample *s);
/* Appends n tokens with their log-probs and versions; -1 when out of
 * memory (the sample then keeps what it had). */
int http_sample_append(http_sample *s, const int *tok, const float *lp, const uint64_t *wv, int n);

/* The JSON answers. Samples are ordered prompt by prompt (s[p * n + k]). */
typedef struct {
    const http_gen *gen;
    http_sample *s;             /* the chunk functions advance what each sample streamed */
    int n_samples;
    const fr_tokenizer *tok;     /* the server's; NULL: answers carry token ids only */
    const char *model;
    const char *id;             /* the call's id ("cmpl-..." / SGLang rid) */
    long created;               /* seconds since the epoch */
} http_view;

/* The whole answer of a call that does not stream. */
void http_answer_generate(const http_view *v, fr_buf *out);
void http_answer_completions(const http_view *v, fr_buf *out);
/* Stream chunks: sample i's new part as one SSE event (SGLang: the sample
 * so far; OpenAI: the delta since the last one), appended to out. */
void http_chunk_generate(const http_view *v, int i, fr_buf *out);
void http_chunk_completions(const http_view *v, int i, fr_buf *out);
void http_chunk_usage(const http_view *v, fr_buf *out);
/* {"error": {"message": ..., "type": ..., "code": status}} */
void http_error_json(fr_buf *out, unsigned status, const char *type, const char *msg);
/* A JSON string literal of s[0, n) (UTF-8 kept, control characters escaped). */
void http_json_str(fr_buf *out, const char *s, size_t n);
const char *http_finish_name(fr_wire_finish f);

/* ---- the server and its calls (http_server.c, http_gateway.c, http_control.c) ---- */

enum { ROLE_NONE = 0, ROLE_READ, ROLE_CLIENT, ROLE_TRAINER };
enum { CALL_NEW = 0, CALL_RUNNING, CALL_READY, CALL_STREAMING };
#define HTTP_CTL_SLOTS 16   /* control calls at once; client 0 carries the generations */

struct MHD_Connection;
typedef struct http_call http_call;

struct http_call {
    fr_http *h;
    struct MHD_Connection *conn;   /* NULL once the connection ended */
    int suspended;
    char url[96];
    int post;
    int role;
    fr_buf body;
    int too_large;
    int state;
    unsigned status;               /* CALL_READY: the answer */
    fr_buf answer;
    const char *ctype;
    /* generation */
    int gen_ok;
    http_gen gen;
    http_sample *s;
    int n_samples, samples_left;
    uint64_t *req_id;              /* per prompt: the engine request's id */
    int *req_open;                 /* per prompt: 1 until its engine request has no open sample */
    int n_open;                    /* prompts whose engine request is open */
    char id[48];
    long created;
    int health;                    /* /health_generate */
    fr_buf out;                    /* stream: bytes not yet taken by libmicrohttpd */
    size_t out_off;
    int end_written;
    /* control: the slot it holds (0: none) and what came back */
    int slot;
    int waiting;                   /* a reply is awaited on the slot */
    fr_msg_type got;
    char code[FR_PROTO_NAME_MAX];
    char message[1024];
    uint64_t u[4];
    int worker;                    /* the disk update's thread runs */
    pthread_cond_t cv;
    http_call *prev, *next;
};

struct fr_http {
    fr_http_config cfg;
    char tokens[3][256];           /* read, client, trainer */
    char model_name[512];
    fr_bridge_server *srv;
    struct MHD_Daemon *d;
    fr_metrics_http *metrics;
    const fr_tokenizer *tok;       /* the server's (NULL: none) and its name */
    const char *tok_name;
    int vocab, n_eos, eos[8];
    int port;
    FILE *log;
    pthread_mutex_t mu;            /* every call's state and the tables below */
    http_call *calls;              /* live calls */
    int stopping;
    uint64_t next_id;
    struct http_route_entry **table; /* engine request id -> (call, prompt) */
    int table_size, table_n;
    http_call *slots[HTTP_CTL_SLOTS + 1];
    http_call **aborts;            /* client 0's abort replies, in order (NULL: an abort of the API's own) */
    int n_aborts, cap_aborts;
};

/* http_server.c */
void http_log(fr_http *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void http_wake(http_call *c);          /* under h->mu: resume a suspended connection */
void http_ready(http_call *c, unsigned status, const char *ctype);   /* under h->mu: answer in c->answer */
void http_fail(http_call *c, unsigned status, const char *type, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void http_maybe_free(http_call *c);    /* under h->mu */
int http_stream_read(http_call *c, char *buf, size_t max);   /* under h->mu: libmicrohttpd's reader */

/* http_gateway.c */
void http_on_msg(void *user, int client, const fr_msg *m);
void http_on_command(void *user, int client, const char *code, const char *message);
void http_start_generation(http_call *c);          /* under h->mu, after c->gen is parsed */
void http_abort_open(http_call *c);                 /* under h->mu */
/* Aborts engine requests ids[0, n) (n 0 with a waiter: every generation of
 * the API's); waiter (NULL: none) gets the abort reply. Under h->mu. */
void http_send_abort(fr_http *h, http_call *waiter, uint64_t *ids, int n);
fr_status http_send(fr_http *h, int client, int trainer, const fr_msg *m);
int http_take_slot(http_call *c);                   /* under h->mu: 0 none free */
void http_release_slot(http_call *c);               /* under h->mu */
void http_table_free(fr_http *h);

/* http_control.c: every route but the generations and the metrics */
int http_control_route(http_call *c);               /* under h->mu: 1 when the url was one of them */
void http_control_reply(http_call *c);              /* under h->mu: a reply on its slot arrived */

/* http_disk.c: /update_weights_from_disk (under h->mu: starts its thread) */
void http_disk_start(http_call *c);

#endif
