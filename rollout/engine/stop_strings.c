/* Stop strings: the matcher (one Knuth-Morris-Pratt automaton per string)
 * and a sample's text state over the tokenizer's detokenizer. */
#include "rollout/engine/stop_strings.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"

/* Length of the well-formed UTF-8 sequence at s[0, n) (RFC 3629: no
 * overlong forms, no surrogates, nothing above U+10FFFF), 0 when there is
 * none. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    const unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t k = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (k == 0 || k > n) return 0;
    unsigned char lo = 0x80, hi = 0xBF;   /* the second byte's range */
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED) hi = 0x9F;
    else if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < k; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return k;
}

static int utf8_valid(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq((const unsigned char *)s + i, n - i);
        if (!k) return 0;
        i += k;
    }
    return 1;
}

fr_status fr_stop_strings_check(const fr_stop_strings *stops, const char *what)
{
    if (!stops || stops->n == 0) return FR_OK;
    if (stops->n < 0 || stops->n > FR_MAX_STOP_STRINGS)
        return fr_fail(FR_EINVAL, "%s: %d stop strings, at most %d may be given", what, stops->n, FR_MAX_STOP_STRINGS);
    if (!stops->s) return fr_fail(FR_EINVAL, "%s: %d stop strings, but no strings", what, stops->n);
    for (int i = 0; i < stops->n; i++) {
        const char *x = stops->s[i];
        size_t len = x ? strnlen(x, FR_MAX_STOP_STRING_BYTES + 1) : 0;
        if (len == 0) return fr_fail(FR_EINVAL, "%s: stop string %d is empty", what, i);
        if (len > FR_MAX_STOP_STRING_BYTES)
            return fr_fail(FR_EINVAL, "%s: stop string %d is longer than %d bytes", what, i, FR_MAX_STOP_STRING_BYTES);
        if (!utf8_valid(x, len)) return fr_fail(FR_EINVAL, "%s: stop string %d is not UTF-8", what, i);
    }
    return FR_OK;
}

/* ---- the matcher ---------------------------------------------------------- */

typedef struct {
    char *s;
    size_t len;
    size_t *fail;   /* fail[k]: the longest proper prefix of s[0, k + 1) that is also its suffix */
    size_t state;   /* the longest end of the text fed that is a prefix of s */
} stop_auto;

struct fr_stop_matcher {
    stop_auto *a;
    int n;
};

void fr_stop_matcher_free(fr_stop_matcher **m)
{
    if (!m || !*m) return;
    for (int i = 0; (*m)->a && i < (*m)->n; i++) {
        free((*m)->a[i].s);
        free((*m)->a[i].fail);
    }
    free((*m)->a);
    free(*m);
    *m = NULL;
}

static void build_fail(stop_auto *a)
{
    a->fail[0] = 0;
    size_t k = 0;
    for (size_t i = 1; i < a->len; i++) {
        while (k > 0 && a->s[i] != a->s[k]) k = a->fail[k - 1];
        if (a->s[i] == a->s[k]) k++;
        a->fail[i] = k;
    }
}

fr_status fr_stop_matcher_new(const fr_stop_strings *stops, fr_stop_matcher **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_stop_matcher_new: no place for the result");
    *out = NULL;
    fr_status st = fr_stop_strings_check(stops, "stop strings");
    if (st) return st;
    fr_stop_matcher *m = calloc(1, sizeof *m);
    const int n = stops ? stops->n : 0;
    if (m && n > 0) m->a = calloc((size_t)n, sizeof *m->a);
    if (!m || (n > 0 && !m->a)) {
        free(m);
        return fr_fail(FR_ENOMEM, "out of memory for stop strings");
    }
    m->n = n;
    for (int i = 0; i < n; i++) {
        stop_auto *a = &m->a[i];
        a->len = strlen(stops->s[i]);
        a->s = malloc(a->len);
        a->fail = malloc(sizeof *a->fail * a->len);
        if (!a->s || !a->fail) {
            fr_stop_matcher_free(&m);
            return fr_fail(FR_ENOMEM, "out of memory for stop strings");
        }
        memcpy(a->s, stops->s[i], a->len);
        build_fail(a);
    }
    *out = m;
    return FR_OK;
}

/* One byte through a's automaton: 1 when a whole match ends with it. */
static int step(stop_auto *a, char c)
{
    size_t k = a->state;
    if (k == a->len) k = a->fail[k - 1];   /* after a match, the text goes on from its longest border */
    while (k > 0 && a->s[k] != c) k = a->fail[k - 1];
    if (a->s[k] == c) k++;
    a->state = k;
    return k == a->len;
}

int fr_stop_matcher_feed(fr_stop_matcher *m, const char *bytes, size_t n, size_t *used)
{
    for (size_t i = 0; m && i < n; i++) {
        int best = -1;
        for (int k = 0; k < m->n; k++)   /* every automaton sees every byte, so each keeps its state */
            if (step(&m->a[k], bytes[i]) && (best < 0 || m->a[k].len > m->a[best].len)) best = k;
        if (best >= 0) {
            if (used) *used = i + 1;
            return best;
        }
    }
    if (used) *used = n;
    return -1;
}

size_t fr_stop_matcher_holdback(const fr_stop_matcher *m)
{
    size_t h = 0;
    for (int k = 0; m && k < m->n; k++)
        if (m->a[k].state < m->a[k].len && m->a[k].state > h) h = m->a[k].state;
    return h;
}

size_t fr_stop_matcher_len(const fr_stop_matcher *m, int i)
{
    return m && i >= 0 && i < m->n ? m->a[i].len : 0;
}

/* ---- a sample's text ------------------------------------------------------ */

struct fr_sample_text {
    fr_detok *d;
    fr_stop_matcher *m;   /* NULL: no stop strings */
    int include;
    fr_buf text;
    size_t stable;
    int matched;          /* -1 while none */
    int ended;            /* matched or finished: the text is final */
};

fr_status fr_sample_text_new(const fr_tokenizer *tok, const fr_stop_strings *stops, int skip_special,
                             fr_sample_text **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_sample_text_new: no place for the result");
    *out = NULL;
    fr_sample_text *t = calloc(1, sizeof *t);
    if (!t) return fr_fail(FR_ENOMEM, "out of memory for a sample's text");
    t->matched = -1;
    t->include = stops && stops->include;
    fr_status st = fr_detok_new(tok, skip_special != 0, &t->d);
    if (!st && stops && stops->n > 0) st = fr_stop_matcher_new(stops, &t->m);
    if (st) {
        fr_sample_text_free(&t);
        return st;
    }
    *out = t;
    return FR_OK;
}

void fr_sample_text_free(fr_sample_text **t)
{
    if (!t || !*t) return;
    fr_detok_free(&(*t)->d);
    fr_stop_matcher_free(&(*t)->m);
    fr_buf_free(&(*t)->text);
    free(*t);
    *t = NULL;
}

/* Appends piece to the text and looks for a stop string in it (passing
 * over those it finds unless may_stop). */
static fr_status take_piece(fr_sample_text *t, const char *piece, size_t n, int may_stop, int *matched)
{
    const size_t before = t->text.len;
    fr_buf_put(&t->text, piece, n);
    if (t->text.failed) return fr_fail(FR_ENOMEM, "out of memory for a sample's text");
    size_t used = 0, at = 0;
    int k = -1;
    while (t->m && at < n && k < 0) {
        k = fr_stop_matcher_feed(t->m, piece + at, n - at, &used);
        at += used;
        if (!may_stop) k = -1;
    }
    if (k >= 0) {
        used = at;
        const size_t end = before + used;
        t->text.len = t->include ? end : end - fr_stop_matcher_len(t->m, k);
        t->text.data[t->text.len] = '\0';
        t->stable = t->text.len;
        t->matched = *matched = k;
        t->ended = 1;
        return FR_OK;
    }
    t->stable = t->text.len - fr_stop_matcher_holdback(t->m);
    return FR_OK;
}

fr_status fr_sample_text_push(fr_sample_text *t, int token, int may_stop, int *matched)
{
    if (matched) *matched = -1;
    if (!t || !matched) return fr_fail(FR_EINVAL, "fr_sample_text_push: no text state or no place for the match");
    if (t->ended) return fr_fail(FR_EINVAL, "fr_sample_text_push: the sample's text has ended");
    const char *piece;
    size_t n;
    fr_status st = fr_detok_push(t->d, token, &piece, &n);
    if (st) return st;
    return n ? take_piece(t, piece, n, may_stop, matched) : FR_OK;
}

fr_status fr_sample_text_finish(fr_sample_text *t)
{
    if (!t) return fr_fail(FR_EINVAL, "fr_sample_text_finish: no text state");
    if (t->ended) return FR_OK;
    const char *piece;
    size_t n;
    fr_status st = fr_detok_finish(t->d, &piece, &n);
    if (st) return st;
    fr_buf_put(&t->text, piece, n);
    if (t->text.failed) return fr_fail(FR_ENOMEM, "out of memory for a sample's text");
    t->stable = t->text.len;
    t->ended = 1;
    return FR_OK;
}

const char *fr_sample_text_get(const fr_sample_text *t, size_t *len, size_t *stable)
{
    const int some = t && t->text.data;
    if (len) *len = some ? t->text.len : 0;
    if (stable) *stable = some ? t->stable : 0;
    return some ? t->text.data : "";
}

int fr_sample_text_matched(const fr_sample_text *t) { return t ? t->matched : -1; }
