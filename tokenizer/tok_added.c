/* Added tokens (tokenizer.json's added_tokens: <|im_start|>, <s>, ...):
 * their ids, and where they occur in a text.
 *
 * Ids follow tokenizers' AddedVocabulary::add_tokens, not the "id" fields:
 * a content already in the vocabulary keeps its id there, a new one takes
 * the next free id from the model vocabulary's size on. For well-formed
 * files the two agree; where they do not, this is what tokenizers encodes.
 *
 * Matching is leftmost-longest over a byte trie (tokenizers uses an
 * Aho-Corasick automaton with the same match kind), then each match is
 * checked and widened by its flags: single_word drops a match inside a
 * word, lstrip and rstrip take the whitespace beside it into the token. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_utf8.h"

void tok_trie_free(tok_trie *tr)
{
    tok_pairmap_free(&tr->edges);
    free(tr->term);
    memset(tr, 0, sizeof *tr);
}

static int trie_node(tok_trie *tr)
{
    int32_t *v = fr_array_room(tr->term, tr->n_nodes, &tr->cap_nodes, sizeof *v, 64);
    if (!v) return -1;
    tr->term = v;
    tr->term[tr->n_nodes] = -1;
    return (int)tr->n_nodes++;
}

static int trie_add(tok_trie *tr, const unsigned char *s, size_t n, int32_t index)
{
    if (!tr->n_nodes && (trie_node(tr) < 0 || tok_pairmap_init(&tr->edges, 64) != 0)) return -1;
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        const tok_pairslot *e = tok_pairmap_get(&tr->edges, tok_pair_key(node, s[i]));
        if (e) {
            node = e->b;
            continue;
        }
        int child = trie_node(tr);
        if (child < 0 || tok_pairmap_put(&tr->edges, tok_pair_key(node, s[i]), 0, child) != 0) return -1;
        node = child;
    }
    tr->first[s[0]] = 1;
    tr->term[node] = index;
    return 0;
}

/* The longest token at s[0..n): its length, with *index set, or 0. */
static size_t trie_longest(const tok_trie *tr, const unsigned char *s, size_t n, int32_t *index)
{
    size_t best = 0;
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        const tok_pairslot *e = tok_pairmap_get(&tr->edges, tok_pair_key(node, s[i]));
        if (!e) break;
        node = e->b;
        if (tr->term[node] >= 0) {
            best = i + 1;
            *index = tr->term[node];
        }
    }
    return best;
}

fr_status tok_build_tries(fr_tokenizer *t)
{
    /* From the id table, so that a token whose id another one took over
     * (tokenizers keeps one token per id) is not matched. */
    for (int id = 0; id < t->n_ids; id++) {
        int32_t k = t->id_added[id];
        if (k < 0) continue;
        const tok_added *a = &t->added[k];
        tok_trie *tr = a->normalized ? &t->norm_trie : &t->raw_trie;
        if (!a->nlen) continue;
        if (trie_add(tr, (const unsigned char *)t->str.data + a->noff, a->nlen, k) != 0)
            return fr_fail(FR_ENOMEM, "out of memory indexing added tokens");
    }
    return FR_OK;
}

static uint32_t char_before(const char *s, size_t at)
{
    uint32_t cp;
    tok_utf8_next(s + tok_utf8_last_start(s, at), &cp);
    return cp;
}

/* tokenizers' AddedVocabulary::find_matches: tr's matches in s with each
 * token's flags applied. */
fr_status tok_added_split(const fr_tokenizer *t, const tok_trie *tr, const char *s, size_t n, tok_segs *out)
{
    out->n = 0;
    size_t start_offset = 0;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; tr->n_nodes && i < n;) {
        if (!tr->first[u[i]]) { i++; continue; }
        int32_t k = -1;
        size_t len = trie_longest(tr, u + i, n - i, &k);
        if (!len) { i++; continue; }
        size_t start = i, stop = i + len;
        i = stop;   /* the automaton goes on after the match, whatever the flags make of it */
        const tok_added *a = &t->added[k];
        uint32_t cp;
        if (a->single_word) {
            int word_before = start > 0 && tok_is_word(char_before(s, start));
            int word_after = stop < n && (tok_utf8_next(s + stop, &cp), tok_is_word(cp));
            if (word_before || word_after) continue;
        }
        if (a->lstrip) {
            size_t ns = start;
            while (ns > 0 && tok_is_whitespace(char_before(s, ns))) ns = tok_utf8_last_start(s, ns);
            start = ns > start_offset ? ns : start_offset;
        }
        if (a->rstrip)
            while (stop < n) {
                int l = tok_utf8_next(s + stop, &cp);
                if (!tok_is_whitespace(cp)) break;
                stop += (size_t)l;
            }
        if (start_offset < start && tok_segs_push(out, (uint32_t)start_offset, (uint32_t)start, 0) != 0) goto oom;
        if (tok_segs_push(out, (uint32_t)start, (uint32_t)stop, (uint32_t)k + 1) != 0) goto oom;
        start_offset = stop;
    }
    if (start_offset < n && tok_segs_push(out, (uint32_t)start_offset, (uint32_t)n, 0) != 0) goto oom;
    return FR_OK;
oom:
    return fr_fail(FR_ENOMEM, "out of memory matching added tokens");
}

/* Reads one entry of added_tokens. */
static fr_status parse_one(const cJSON *j, size_t i, tok_added *a, const char **content)
{
    *content = tok_json_str(j, "content");
    if (!cJSON_IsObject(j) || !*content)
        return fr_fail(FR_EFORMAT, "added_tokens[%zu]: not an object with a string \"content\"", i);
    static const char *const flags[] = {"single_word", "lstrip", "rstrip", "normalized", "special"};
    unsigned char *dst[] = {&a->single_word, &a->lstrip, &a->rstrip, &a->normalized, &a->special};
    for (int f = 0; f < 5; f++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, flags[f]);
        if (v && !cJSON_IsBool(v))
            return fr_fail(FR_EFORMAT, "added_tokens[%zu] (%s): \"%s\" is not a boolean", i, *content, flags[f]);
        /* AddedToken's defaults: normalized true, the others false. */
        *dst[f] = v ? (unsigned char)cJSON_IsTrue(v) : f == 3;
    }
    return FR_OK;
}

/* Whether two added tokens are the same token (every field equal). */
static int same_token(const fr_tokenizer *t, const tok_added *x, const tok_added *y)
{
    return x->len == y->len && memcmp(t->str.data + x->off, t->str.data + y->off, x->len) == 0 &&
           x->single_word == y->single_word && x->lstrip == y->lstrip && x->rstrip == y->rstrip &&
           x->normalized == y->normalized && x->special == y->special;
}

/* The string a normalized token is matched and decoded as: its content
 * through the normalizers. */
static fr_status normalized_content(fr_tokenizer *t, tok_added *a)
{
    a->noff = a->off;
    a->nlen = a->len;
    if (!a->normalized || !t->n_norm) return FR_OK;
    tok_ws *ws = tok_ws_get(t);
    if (!ws) return FR_ENOMEM;
    const char *res;
    size_t rl;
    fr_status st = tok_normalize(t, ws, t->str.data + a->off, a->len, &res, &rl);
    if (st == FR_OK) {
        /* res may point into the arena itself, which the append can move. */
        fr_buf copy = {0};
        fr_buf_put(&copy, res, rl);
        uint32_t off = copy.failed ? UINT32_MAX : tok_str_add(t, copy.data, rl);
        fr_buf_free(&copy);
        if (off == UINT32_MAX) st = fr_fail(FR_ENOMEM, "out of memory for added tokens");
        a->noff = off;
        a->nlen = (uint32_t)rl;
    }
    tok_ws_put(t, ws);
    return st;
}

fr_status tok_parse_added(fr_tokenizer *t, const cJSON *list)
{
    if (!list || cJSON_IsNull(list)) return FR_OK;
    if (!cJSON_IsArray(list)) return fr_fail(FR_EFORMAT, "added_tokens is not a list");
    size_t n = (size_t)cJSON_GetArraySize(list), i = 0;
    t->added = calloc(n ? n : 1, sizeof *t->added);
    if (!t->added || tok_strmap_init(&t->added_map, n) != 0) return fr_fail(FR_ENOMEM, "out of memory for added tokens");
    int next_id = (int)t->bpe.n_vocab;
    for (const cJSON *j = list->child; j; j = j->next, i++) {
        tok_added a = {0};
        const char *content;
        fr_status st = parse_one(j, i, &a, &content);
        if (st != FR_OK) return st;
        if (!*content) continue;
        a.len = (uint32_t)strlen(content);
        a.off = tok_str_add(t, content, a.len);
        if (a.off == UINT32_MAX) return fr_fail(FR_ENOMEM, "out of memory for added tokens");
        int id = tok_strmap_get(&t->added_map, t->str.data, content, a.len);
        if (id >= 0 && id < t->n_ids && t->id_added[id] >= 0 && same_token(t, &t->added[t->id_added[id]], &a)) continue;
        if (id < 0) id = tok_strmap_get(&t->bpe.vocab, t->str.data, content, a.len);
        if (id < 0) id = next_id++;
        a.id = id;
        if ((st = normalized_content(t, &a)) != FR_OK) return st;
        if (tok_strmap_put(&t->added_map, t->str.data, a.off, a.len, id) != 0 || tok_set_id(t, id, UINT32_MAX, 0) != 0)
            return fr_fail(FR_ENOMEM, "out of memory for added tokens");
        t->added[t->n_added] = a;
        t->id_added[id] = (int32_t)t->n_added++;
    }
    return FR_OK;
}
