#include "trainer_bridge/server/metrics_pub.h"

#include <errno.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

struct fr_metrics_pub {
    void *sock;
    char endpoint[256];
};

/* ---- JSON of fr_metrics_json -> msgpack ------------------------------------
 * The snapshot's JSON is the one definition of its keys; re-encoding that
 * text keeps the PUB socket and /metrics.json equal by construction. The
 * text is ours (strings have no escapes: rollout/monitor/metrics.c cleans them), so
 * a small exact reader suffices; integers stay integers (64-bit exact). */

typedef struct {
    const char *p, *end;
    msgpack_packer *pk;
    int depth;
} reader;

static void skip_ws(reader *r)
{
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\n' || *r->p == '\t' || *r->p == '\r')) r->p++;
}

static int value(reader *r);

static int string(reader *r)
{
    if (r->p >= r->end || *r->p != '"') return -1;
    const char *s = ++r->p;
    while (r->p < r->end && *r->p != '"') {
        if (*r->p == '\\') return -1;   /* never written by metrics.c */
        r->p++;
    }
    if (r->p >= r->end) return -1;
    size_t n = (size_t)(r->p - s);
    r->p++;
    msgpack_pack_str(r->pk, n);
    msgpack_pack_str_body(r->pk, s, n);
    return 0;
}

static int number(reader *r)
{
    const char *s = r->p;
    int integral = 1;
    while (r->p < r->end && strchr("+-0123456789.eE", *r->p)) {
        if (*r->p == '.' || *r->p == 'e' || *r->p == 'E') integral = 0;
        r->p++;
    }
    if (r->p == s) return -1;
    char buf[64];
    size_t n = (size_t)(r->p - s);
    if (n >= sizeof buf) return -1;
    memcpy(buf, s, n);
    buf[n] = 0;
    char *e;
    errno = 0;
    if (integral && buf[0] == '-') {
        long long v = strtoll(buf, &e, 10);
        if (*e || errno) return -1;
        msgpack_pack_int64(r->pk, v);
    } else if (integral) {
        unsigned long long v = strtoull(buf, &e, 10);
        if (*e || errno) return -1;
        msgpack_pack_uint64(r->pk, v);
    } else {
        double v = strtod(buf, &e);
        if (*e) return -1;
        msgpack_pack_double(r->pk, v);
    }
    return 0;
}

/* Counts the elements of the array or object at r->p (one level), so the
 * msgpack header can come first. */
static int count_items(const char *p, const char *end)
{
    int depth = 0, commas = 0, any = 0, in_str = 0;
    for (p++; p < end; p++) {
        char c = *p;
        if (in_str) {
            if (c == '"') in_str = 0;
            continue;
        }
        if (depth == 0 && (c == '}' || c == ']')) return any ? commas + 1 : 0;
        if (c != ' ' && c != '\n' && c != '\t' && c != '\r') any = 1;
        if (c == '"') in_str = 1;
        else if (c == '{' || c == '[') depth++;
        else if (c == '}' || c == ']') depth--;
        else if (c == ',' && depth == 0) commas++;
    }
    return -1;
}

static int container(reader *r, char close, int is_map)
{
    if (++r->depth > 16) return -1;
    int n = count_items(r->p, r->end);
    if (n < 0) return -1;
    if (is_map) msgpack_pack_map(r->pk, (size_t)n);
    else msgpack_pack_array(r->pk, (size_t)n);
    r->p++;
    for (int i = 0; i < n; i++) {
        skip_ws(r);
        if (is_map) {
            if (string(r)) return -1;
            skip_ws(r);
            if (r->p >= r->end || *r->p != ':') return -1;
            r->p++;
            skip_ws(r);
        }
        if (value(r)) return -1;
        skip_ws(r);
        if (i + 1 < n) {
            if (r->p >= r->end || *r->p != ',') return -1;
            r->p++;
        }
    }
    skip_ws(r);
    if (r->p >= r->end || *r->p != close) return -1;
    r->p++;
    r->depth--;
    return 0;
}

static int literal(reader *r, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(r->end - r->p) < n || memcmp(r->p, word, n)) return -1;
    r->p += n;
    return 0;
}

static int value(reader *r)
{
    skip_ws(r);
    if (r->p >= r->end) return -1;
    switch (*r->p) {
    case '{': return container(r, '}', 1);
    case '[': return container(r, ']', 0);
    case '"': return string(r);
    case 't': if (literal(r, "true")) return -1; msgpack_pack_true(r->pk); return 0;
    case 'f': if (literal(r, "false")) return -1; msgpack_pack_false(r->pk); return 0;
    case 'n': if (literal(r, "null")) return -1; msgpack_pack_nil(r->pk); return 0;
    default: return number(r);
    }
}

fr_status fr_metrics_msgpack(const fr_metrics_snapshot *s, char **out, size_t *len)
{
    if (!s || !out || !len) return fr_fail(FR_EINVAL, "fr_metrics_msgpack: NULL argument");
    char *json = NULL;
    size_t jlen = 0;
    fr_status st = fr_metrics_json(s, &json, &jlen);
    if (st) return st;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    reader r = {json, json + jlen, &pk, 0};
    int bad = value(&r);
    skip_ws(&r);
    bad = bad || r.p != r.end;
    free(json);
    if (bad || !sb.data) {
        msgpack_sbuffer_destroy(&sb);
        return fr_fail(bad ? FR_EINTERNAL : FR_ENOMEM, "metrics: cannot encode the snapshot as msgpack");
    }
    *out = sb.data;   /* malloc'd by msgpack_sbuffer */
    *len = sb.size;
    return FR_OK;
}

/* ---- the socket ------------------------------------------------------------ */

fr_status fr_metrics_pub_open(void *zctx, const char *endpoint, const char *curve_secret_key, fr_metrics_pub **out)
{
    if (!out) return fr_fail(FR_EINVAL, "metrics PUB socket: out is NULL");
    *out = NULL;
    if (!zctx || !endpoint || !endpoint[0]) return fr_fail(FR_EINVAL, "metrics PUB socket: no endpoint");
    fr_metrics_pub *p = calloc(1, sizeof *p);
    if (!p) return fr_fail(FR_ENOMEM, "metrics PUB socket: out of memory");
    p->sock = zmq_socket(zctx, ZMQ_PUB);
    int zero = 0, hwm = 64, one = 1;
    fr_status st = FR_OK;
    if (!p->sock || zmq_setsockopt(p->sock, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(p->sock, ZMQ_SNDHWM, &hwm, sizeof hwm)) {
        st = fr_fail(FR_EIO, "metrics PUB socket: cannot make it: %s", zmq_strerror(errno));
    } else if (curve_secret_key && curve_secret_key[0] &&
               (zmq_setsockopt(p->sock, ZMQ_CURVE_SERVER, &one, sizeof one) ||
                zmq_setsockopt(p->sock, ZMQ_CURVE_SECRETKEY, curve_secret_key, strlen(curve_secret_key)))) {
        st = fr_fail(FR_EIO, "metrics PUB socket: cannot make it a CURVE server: %s", zmq_strerror(errno));
    } else if (zmq_bind(p->sock, endpoint)) {
        st = fr_fail(FR_EIO, "metrics PUB socket: cannot bind %s: %s", endpoint, zmq_strerror(errno));
    }
    if (st) {
        fr_metrics_pub_close(&p);
        return st;
    }
    size_t n = sizeof p->endpoint;
    if (zmq_getsockopt(p->sock, ZMQ_LAST_ENDPOINT, p->endpoint, &n)) snprintf(p->endpoint, sizeof p->endpoint, "%s", endpoint);
    *out = p;
    return FR_OK;
}

const char *fr_metrics_pub_endpoint(const fr_metrics_pub *p) { return p ? p->endpoint : ""; }

fr_status fr_metrics_pub_send(fr_metrics_pub *p, const fr_metrics_snapshot *s)
{
    if (!p || !s) return fr_fail(FR_EINVAL, "fr_metrics_pub_send: NULL argument");
    char *body = NULL;
    size_t len = 0;
    fr_status st = fr_metrics_msgpack(s, &body, &len);
    if (st) return st;
    /* A PUB socket never blocks: at the high-water mark it drops. */
    if (zmq_send(p->sock, FR_METRICS_TOPIC, strlen(FR_METRICS_TOPIC), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(p->sock, body, len, ZMQ_DONTWAIT) < 0)
        st = errno == EAGAIN ? FR_OK : fr_fail(FR_EIO, "metrics PUB socket: send failed: %s", zmq_strerror(errno));
    free(body);
    return st;
}

void fr_metrics_pub_close(fr_metrics_pub **pp)
{
    if (!pp || !*pp) return;
    if ((*pp)->sock) zmq_close((*pp)->sock);
    free(*pp);
    *pp = NULL;
}
