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

/* ---- text in and out (http_text.c) ---------------------------------------- */

/* The model's text: a tokenizer.json's, a byte-level model's bytes, or none
 * (text is then refused and answers carry no text). */
typedef struct http_text http_text;

/* vocab, bos, eos: the model's (a byte-level model is bos 256, vocab <= 512). */
fr_status http_text_new(const char *model_dir, int vocab, int bos, http_text **out);
void http_text_free(http_text **t);
int http_text_has(const http_text *t);
const char *http_text_kind(const http_text *t);   /* "tokenizer.json", "bytes", "none" */
/* Text to ids, with the model's beginning-of-sequence token (as
 * `fp4rollout generate --prompt` and Hugging Face's add_special_tokens). */
fr_status http_text_encode(const http_text *t, const char *s, size_t n, int **ids, int *n_ids);
/* Incremental decoding: push ids one at a time, complete text appended to out. */
typedef struct http_detok http_detok;
fr_status http_detok_new(const http_text *t, int skip_special, http_detok **out);
fr_status http_detok_push(http_detok *d, int id, fr_buf *out);
fr_status http_detok_finish(http_detok *d, fr_buf *out);
void http_detok_free(http_detok **d);
/* The text of ids[0, n), appended to out (nothing without text). */
void http_text_decode(const http_text *t, const int *ids, int n, int skip_special, fr_buf *out);
/* One token's own text (OpenAI's logprobs.tokens), appended to out. */
void http_text_token(const http_text *t, int id, fr_buf *out);

/* ---- parsed requests (http_parse.c) --------------------------------------- */

enum { API_SGLANG = 1, API_OPENAI = 2 };

#define HTTP_MAX_STOPS 64
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
    fr_msg_generate g;          /* the sampling keys (prompt, n and request_id are set per request) */
    int ignore_eos;
    char *stop[HTTP_MAX_STOPS]; /* stop strings (owned) */
    int n_stop;
    int skip_special;           /* decoded text leaves special tokens out (1) */
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
 * the field that is wrong. text: the model's, for text prompts (may be
 * NULL: text refused). */
fr_status http_parse_generate(const char *body, size_t len, const http_text *text, http_gen *out);
fr_status http_parse_completions(const char *body, size_t len, const http_text *text, http_gen *out);
void http_gen_free(http_gen *g);

/* ---- results and answers (http_answer.c) ----------------------------------- */

/* One sample as the calls see it. */
typedef struct {
    int *tok;
    float *lp;
    uint64_t *wv;
    int n, cap;
    fr_buf text;                /* its text so far (cut at a stop string) */
    size_t text_sent;           /* bytes streamed (OpenAI deltas) */
    int tok_sent;               /* tokens streamed */
    int final_sent;             /* its last stream chunk went out */
    int got_done;               /* the engine's done came */
    int dirty;                  /* changed since its last stream chunk */
    http_detok *dt;
    int ended;                  /* its done came, or a stop string ended it */
    int by_string;              /* a stop string ended it (the engine's done is still to come) */
    fr_wire_finish finish;
    char *matched;              /* the stop string that ended it */
    char why[256];              /* abort or error: what happened */
    int *top_ids;               /* from its done: [n * top_k] */
    float *top_lps;
    int top_k;
    float *plp;                 /* the prompt's log-probs (shared by the prompt's samples: owned by sample 0) */
    int n_plp;
    int has_seed;
    uint64_t seed;
    int sample;
    int n_prompt, preemptions;
    double ttft_ms, total_ms;
    fr_msg_divergence div;      /* summary only (kl NULL) */
} http_sample;

void http_sample_free(http_sample *s);

/* The JSON answers. Samples are ordered prompt by prompt (s[p * n + k]). */
typedef struct {
    const http_gen *gen;
    http_sample *s;             /* the chunk functions advance what each sample streamed */
    int n_samples;
    const http_text *text;      /* NULL or no text: answers carry token ids only */
    size_t hold;                /* stream: bytes of text held back while a stop string could still match */
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
    char model_name[512], model_dir[4096];
    fr_bridge_server *srv;
    struct MHD_Daemon *d;
    fr_metrics_http *metrics;
    http_text *text;
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
