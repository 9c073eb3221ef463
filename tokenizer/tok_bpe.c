/* The BPE model on one pre-token: initial symbols (one per character, with
 * byte fallback and unknown tokens), then merges, lowest rank first and the
 * leftmost of equal ranks, which is the order `tokenizers`' heap pops them
 * in. Short words scan for the best pair (a few symbols: a scan beats a
 * heap); long ones use a binary heap of (rank, position), so a word of n
 * symbols costs O(n log n), not O(n^2).
 *
 * Results of words under 256 bytes are cached per workspace (tokenizers
 * caches the same way): most pre-tokens of a text are words seen before. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

enum { CACHE_MAX_KEY = 256, CACHE_SLOTS = 1 << 15, CACHE_BYTES = 4 << 20, SCAN_MAX = 48 };

int tok_ws_push_id(tok_ws *ws, int id)
{
    int *v = fr_array_room(ws->ids, ws->n_ids, &ws->cap_ids, sizeof *v, 1024);
    if (!v) return -1;
    ws->ids = v;
    ws->ids[ws->n_ids++] = id;
    return 0;
}

/* ---- cache ---- */

void tok_cache_free(tok_cache *c)
{
    free(c->hash);
    free(c->entry);
    fr_buf_free(&c->data);
    memset(c, 0, sizeof *c);
}

static uint64_t cache_hash(const char *s, size_t n)
{
    uint64_t h = tok_hash(s, n);
    return h ? h : 1;
}

/* Appends the cached ids of key to ws->ids: 1 when found, 0 when not. */
static int cache_get(tok_ws *ws, uint64_t h, const char *key, size_t n)
{
    tok_cache *c = &ws->cache;
    if (!c->cap) return 0;
    for (size_t i = (size_t)h & (c->cap - 1);; i = (i + 1) & (c->cap - 1)) {
        if (!c->hash[i]) return 0;
        if (c->hash[i] != h) continue;
        const char *e = c->data.data + c->entry[i];
        uint32_t klen, nid;
        memcpy(&klen, e, 4);
        memcpy(&nid, e + 4, 4);
        if (klen != n || memcmp(e + 8, key, n) != 0) continue;
        const char *ids = e + 8 + ((klen + 3) & ~3u);
        for (uint32_t k = 0; k < nid; k++) {
            int id;
            memcpy(&id, ids + 4 * k, 4);
            if (tok_ws_push_id(ws, id) != 0) return -1;
        }
        return 1;
    }
}

/* Remembers key -> ids; a full cache starts over (a long-running server's
 * vocabulary of words drifts, so it keeps the recent ones). */
static void cache_put(tok_ws *ws, uint64_t h, const char *key, size_t n, const int *ids, size_t nid)
{
    tok_cache *c = &ws->cache;
    if (!c->cap) {
        c->hash = calloc(CACHE_SLOTS, sizeof *c->hash);
        c->entry = malloc(CACHE_SLOTS * sizeof *c->entry);
        if (!c->hash || !c->entry) { tok_cache_free(c); return; }
        c->cap = CACHE_SLOTS;
    }
    size_t need = 8 + ((n + 3) & ~(size_t)3) + 4 * nid;
    if (2 * (c->count + 1) > c->cap || c->data.len + need > CACHE_BYTES) {
        memset(c->hash, 0, c->cap * sizeof *c->hash);
        c->count = 0;
        c->data.len = 0;
    }
    if (fr_buf_reserve(&c->data, need) != 0) { c->data.failed = 0; return; }
    size_t i = (size_t)h & (c->cap - 1);
    while (c->hash[i]) i = (i + 1) & (c->cap - 1);
    char *e = c->data.data + c->data.len;
    uint32_t klen = (uint32_t)n, cnt = (uint32_t)nid;
    memcpy(e, &klen, 4);
    memcpy(e + 4, &cnt, 4);
    memcpy(e + 8, key, n);
    memcpy(e + 8 + ((n + 3) & ~(size_t)3), ids, 4 * nid);
    c->hash[i] = h;
    c->entry[i] = (uint32_t)c->data.len;
    c->data.len += need;
    c->count++;
}

/* ---- initial symbols ---- */

/* The id of one piece of the word: the character, with the prefix when it
 * is not the first and the suffix when it is the last (-1: not in the
 * vocabulary, -2: out of memory). *piece, *plen: the bytes looked up. */
static int32_t piece_id(const tok_bpe *m, const fr_tokenizer *t, tok_ws *ws, const char *c, size_t clen,
                        int first, int last, const char **piece, size_t *plen)
{
    int pre = !first && m->prefix, suf = last && m->suffix;
    *piece = c;
    *plen = clen;
    if (!pre && !suf) {
        uint32_t cp;
        tok_utf8_next(c, &cp);
        if (cp < 0x800) return m->char_id[cp];
        return tok_strmap_get(&m->vocab, t->str.data, c, clen);
    }
    ws->word.len = 0;
    if (pre) fr_buf_put(&ws->word, m->prefix, m->prefix_len);
    fr_buf_put(&ws->word, c, clen);
    if (suf) fr_buf_put(&ws->word, m->suffix, m->suffix_len);
    if (ws->word.failed) return -2;
    *piece = ws->word.data;
    *plen = ws->word.len;
    return tok_strmap_get(&m->vocab, t->str.data, ws->word.data, ws->word.len);
}

/* Grows the symbol array to hold n symbols (4 ints each). */
static int sym_reserve(tok_ws *ws, size_t n)
{
    if (n <= ws->cap_sym) return 0;
    size_t cap = ws->cap_sym ? ws->cap_sym : 64;
    while (cap < n) cap *= 2;
    int32_t *v = realloc(ws->sym, cap * 4 * sizeof *v);
    if (!v) return -1;
    ws->sym = v;
    ws->cap_sym = cap;
    return 0;
}

/* Appends symbol id; -1 when memory ran out. */
static int sym_add(tok_ws *ws, size_t *n, int32_t id)
{
    if (sym_reserve(ws, *n + 1) != 0) return -1;
    ws->sym[4 * *n] = id;
    (*n)++;
    return 0;
}

/* The symbols of a model string, as tokenizers' merge_word builds them:
 * characters missing from the vocabulary become <0xNN> byte tokens
 * (byte_fallback) or the unknown token (runs of it fused with fuse_unk),
 * or vanish when there is neither. */
static fr_status initial_symbols(const fr_tokenizer *t, tok_ws *ws, const char *s, size_t n, size_t *nsym)
{
    const tok_bpe *m = &t->bpe;
    int32_t unk = -1;   /* a pending unknown token */
    *nsym = 0;
    for (size_t i = 0; i < n;) {
        size_t clen = (size_t)tok_utf8_len((unsigned char)s[i]), plen;
        const char *piece;
        int32_t id = piece_id(m, t, ws, s + i, clen, i == 0, i + clen == n, &piece, &plen);
        i += clen;
        if (id == -2) return fr_fail(FR_ENOMEM, "out of memory encoding a word");
        if (id >= 0) {
            if (unk >= 0 && sym_add(ws, nsym, unk) != 0) goto oom;
            unk = -1;
            if (sym_add(ws, nsym, id) != 0) goto oom;
            continue;
        }
        if (m->byte_fallback) {
            /* All the piece's bytes as <0xNN> tokens, or none of them. A
             * pending unknown token stays pending, as in tokenizers. */
            int all = 1;
            for (size_t k = 0; k < plen; k++) all &= m->fallback_id[(unsigned char)piece[k]] >= 0;
            if (all) {
                for (size_t k = 0; k < plen; k++)
                    if (sym_add(ws, nsym, m->fallback_id[(unsigned char)piece[k]]) != 0) goto oom;
                continue;
            }
        }
        if (m->unk_id >= 0) {
            if (unk >= 0 && !m->fuse_unk && sym_add(ws, nsym, unk) != 0) goto oom;
            unk = m->unk_id;
        }
    }
    if (unk >= 0 && sym_add(ws, nsym, unk) != 0) goto oom;
    return FR_OK;
oom:
    return fr_fail(FR_ENOMEM, "out of memory encoding a word");
}

/* ---- merges ---- */

#define SYM_ID(i) ws->sym[4 * (i)]
#define SYM_PREV(i) ws->sym[4 * (i) + 1]
#define SYM_NEXT(i) ws->sym[4 * (i) + 2]
#define SYM_RANK(i) ws->sym[4 * (i) + 3]

/* The rank of the pair starting at symbol i (INT32_MAX: no merge). */
static int32_t pair_rank(const tok_bpe *m, tok_ws *ws, int32_t i)
{
    if (SYM_NEXT(i) < 0) return INT32_MAX;
    const tok_pairslot *p = tok_pairmap_get(&m->merges, tok_pair_key(SYM_ID(i), SYM_ID(SYM_NEXT(i))));
    return p ? (int32_t)p->a : INT32_MAX;
}

/* Merges symbol i with the one after it. */
static void merge_at(const tok_bpe *m, tok_ws *ws, int32_t i)
{
    int32_t j = SYM_NEXT(i);
    SYM_ID(i) = tok_pairmap_get(&m->merges, tok_pair_key(SYM_ID(i), SYM_ID(j)))->b;
    SYM_NEXT(i) = SYM_NEXT(j);
    if (SYM_NEXT(j) >= 0) SYM_PREV(SYM_NEXT(j)) = i;
    SYM_ID(j) = -1;
}

static void merge_scan(const tok_bpe *m, tok_ws *ws, size_t n)
{
    for (size_t i = 0; i < n; i++) SYM_RANK(i) = pair_rank(m, ws, (int32_t)i);
    for (;;) {
        int32_t best = -1, best_rank = INT32_MAX;
        for (int32_t i = 0; i >= 0; i = SYM_NEXT(i))
            if (SYM_RANK(i) < best_rank) { best_rank = SYM_RANK(i); best = i; }
        if (best < 0) return;
        merge_at(m, ws, best);
        SYM_RANK(best) = pair_rank(m, ws, best);
        if (SYM_PREV(best) >= 0) SYM_RANK(SYM_PREV(best)) = pair_rank(m, ws, SYM_PREV(best));
    }
}

static void heap_push(uint64_t *h, size_t *n, uint64_t v)
{
    size_t i = (*n)++;
    while (i > 0 && h[(i - 1) / 2] > v) { h[i] = h[(i - 1) / 2]; i = (i - 1) / 2; }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0], v = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
    return top;
}

static fr_status merge_heap(const tok_bpe *m, tok_ws *ws, size_t n)
{
    /* Each merge pushes at most two entries: n initial ones and 2n more. */
    if (ws->cap_heap < 3 * n) {
        uint64_t *h = realloc(ws->heap, 3 * n * sizeof *h);
        if (!h) return fr_fail(FR_ENOMEM, "out of memory merging a word of %zu symbols", n);
        ws->heap = h;
        ws->cap_heap = 3 * n;
    }
    uint64_t *h = ws->heap;
    size_t nh = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t r = pair_rank(m, ws, (int32_t)i);
        if (r != INT32_MAX) heap_push(h, &nh, (uint64_t)r << 32 | i);
    }
    while (nh) {
        uint64_t top = heap_pop(h, &nh);
        int32_t i = (int32_t)(uint32_t)top, r = (int32_t)(top >> 32);
        /* Stale entries: the symbol was merged away, or its pair changed. */
        if (SYM_ID(i) < 0 || pair_rank(m, ws, i) != r) continue;
        merge_at(m, ws, i);
        int32_t p = SYM_PREV(i), rp = p >= 0 ? pair_rank(m, ws, p) : INT32_MAX, ri = pair_rank(m, ws, i);
        if (rp != INT32_MAX) heap_push(h, &nh, (uint64_t)rp << 32 | (uint32_t)p);
        if (ri != INT32_MAX) heap_push(h, &nh, (uint64_t)ri << 32 | (uint32_t)i);
    }
    return FR_OK;
}

/* Merges the nsym symbols in ws->sym and appends the result to ws->ids. */
static fr_status merge_and_emit(const tok_bpe *m, tok_ws *ws, size_t nsym)
{
    if (!nsym) return FR_OK;
    for (size_t i = 0; i < nsym; i++) {
        SYM_PREV(i) = (int32_t)i - 1;
        SYM_NEXT(i) = i + 1 < nsym ? (int32_t)i + 1 : -1;
    }
    if (nsym <= SCAN_MAX) merge_scan(m, ws, nsym);
    else if (merge_heap(m, ws, nsym) != FR_OK) return FR_ENOMEM;
    for (int32_t i = 0; i >= 0; i = SYM_NEXT(i))
        if (tok_ws_push_id(ws, SYM_ID(i)) != 0) return fr_fail(FR_ENOMEM, "out of memory for token ids");
    return FR_OK;
}

fr_status tok_bpe_word(const fr_tokenizer *t, tok_ws *ws, const char *s, size_t n, int mapped)
{
    const tok_bpe *m = &t->bpe;
    if (!n) return FR_OK;
    int raw = mapped && m->bytes_ok;
    if (mapped && (!raw || m->ignore_merges)) {
        /* The byte-level spelling is needed as a string. */
        ws->mapped.len = 0;
        tok_bytelevel_map(&ws->mapped, s, n);
        if (ws->mapped.failed) return fr_fail(FR_ENOMEM, "out of memory encoding a word");
        if (m->ignore_merges) {
            int32_t id = tok_strmap_get(&m->vocab, t->str.data, ws->mapped.data, ws->mapped.len);
            if (id >= 0) return tok_ws_push_id(ws, id) ? fr_fail(FR_ENOMEM, "out of memory for token ids") : FR_OK;
        }
        if (!raw) {
            s = ws->mapped.data;
            n = ws->mapped.len;
        }
    } else if (!mapped && m->ignore_merges) {
        int32_t id = tok_strmap_get(&m->vocab, t->str.data, s, n);
        if (id >= 0) return tok_ws_push_id(ws, id) ? fr_fail(FR_ENOMEM, "out of memory for token ids") : FR_OK;
    }
    int cacheable = n < CACHE_MAX_KEY;
    uint64_t h = cacheable ? cache_hash(s, n) : 0;
    if (cacheable) {
        int got = cache_get(ws, h, s, n);
        if (got < 0) return fr_fail(FR_ENOMEM, "out of memory for token ids");
        if (got) return FR_OK;
    }
    size_t nsym = 0, first = ws->n_ids;
    if (raw) {
        if (sym_reserve(ws, n) != 0) return fr_fail(FR_ENOMEM, "out of memory encoding a word");
        for (size_t i = 0; i < n; i++) SYM_ID(i) = m->byte_id[(unsigned char)s[i]];
        nsym = n;
    } else {
        fr_status st = initial_symbols(t, ws, s, n, &nsym);
        if (st != FR_OK) return st;
    }
    fr_status st = merge_and_emit(m, ws, nsym);
    if (st != FR_OK) return st;
    if (cacheable && ws->n_ids > first) cache_put(ws, h, s, n, ws->ids + first, ws->n_ids - first);
    return FR_OK;
}
