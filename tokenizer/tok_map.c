#include "tok_map.h"

#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

uint64_t tok_hash(const void *p, size_t len) { return XXH3_64bits(p, len); }

static size_t cap_for(size_t expected)
{
    size_t cap = 16;
    while (cap < 2 * expected + 2) cap *= 2;
    return cap;
}

/* The slot tag of a hash: never 0, which marks an empty slot. */
static uint32_t tag_of(uint64_t h)
{
    uint32_t t = (uint32_t)(h >> 32);
    return t ? t : 1;
}

int tok_strmap_init(tok_strmap *m, size_t expected)
{
    m->cap = cap_for(expected);
    m->count = 0;
    m->slots = calloc(m->cap, sizeof *m->slots);
    return m->slots ? 0 : -1;
}

void tok_strmap_free(tok_strmap *m)
{
    free(m->slots);
    memset(m, 0, sizeof *m);
}

/* Where a tag's probe starts: the tag spread over the table by a
 * multiplicative hash, so growing the table needs no key bytes. */
static size_t start_of(uint32_t tag, size_t cap) { return (size_t)(tag * 0x9E3779B97F4A7C15ull) & (cap - 1); }

static int strmap_grow(tok_strmap *m)
{
    tok_strmap bigger = {calloc(m->cap * 2, sizeof *m->slots), m->cap * 2, m->count};
    if (!bigger.slots) return -1;
    for (size_t i = 0; i < m->cap; i++) {
        tok_strslot s = m->slots[i];
        if (!s.hash) continue;
        size_t j = start_of(s.hash, bigger.cap);
        while (bigger.slots[j].hash) j = (j + 1) & (bigger.cap - 1);
        bigger.slots[j] = s;
    }
    free(m->slots);
    *m = bigger;
    return 0;
}

int tok_strmap_put(tok_strmap *m, const char *arena, uint32_t off, uint32_t len, int32_t value)
{
    if (2 * (m->count + 1) > m->cap && strmap_grow(m) != 0) return -1;
    uint32_t tag = tag_of(tok_hash(arena + off, len));
    size_t i = start_of(tag, m->cap);
    for (;; i = (i + 1) & (m->cap - 1)) {
        tok_strslot *s = &m->slots[i];
        if (!s->hash) break;
        if (s->hash == tag && s->len == len && memcmp(arena + s->off, arena + off, len) == 0) {
            s->value = value;
            return 0;
        }
    }
    m->slots[i] = (tok_strslot){tag, len, off, value};
    m->count++;
    return 0;
}

int32_t tok_strmap_get(const tok_strmap *m, const char *arena, const char *key, size_t len)
{
    if (!m->cap) return -1;
    uint32_t tag = tag_of(tok_hash(key, len));
    for (size_t i = start_of(tag, m->cap);; i = (i + 1) & (m->cap - 1)) {
        const tok_strslot *s = &m->slots[i];
        if (!s->hash) return -1;
        if (s->hash == tag && s->len == len && memcmp(arena + s->off, key, len) == 0) return s->value;
    }
}

/* The probe start of a 64-bit key: a multiplicative hash's high bits. */
static size_t pair_start(uint64_t key, size_t cap)
{
    uint64_t h = (key ^ (key >> 29)) * 0xBF58476D1CE4E5B9ull;
    return (size_t)(h >> 20) & (cap - 1);
}

int tok_pairmap_init(tok_pairmap *m, size_t expected)
{
    m->cap = cap_for(expected);
    m->count = 0;
    m->slots = malloc(m->cap * sizeof *m->slots);
    if (!m->slots) return -1;
    for (size_t i = 0; i < m->cap; i++) m->slots[i].key = UINT64_MAX;
    return 0;
}

void tok_pairmap_free(tok_pairmap *m)
{
    free(m->slots);
    memset(m, 0, sizeof *m);
}

static int pairmap_grow(tok_pairmap *m)
{
    tok_pairmap bigger;
    if (tok_pairmap_init(&bigger, m->cap) != 0) return -1;
    for (size_t i = 0; i < m->cap; i++) {
        if (m->slots[i].key == UINT64_MAX) continue;
        size_t j = pair_start(m->slots[i].key, bigger.cap);
        while (bigger.slots[j].key != UINT64_MAX) j = (j + 1) & (bigger.cap - 1);
        bigger.slots[j] = m->slots[i];
    }
    bigger.count = m->count;
    free(m->slots);
    *m = bigger;
    return 0;
}

int tok_pairmap_put(tok_pairmap *m, uint64_t key, uint32_t a, int32_t b)
{
    if (2 * (m->count + 1) > m->cap && pairmap_grow(m) != 0) return -1;
    size_t i = pair_start(key, m->cap);
    while (m->slots[i].key != UINT64_MAX && m->slots[i].key != key) i = (i + 1) & (m->cap - 1);
    if (m->slots[i].key == UINT64_MAX) m->count++;
    m->slots[i] = (tok_pairslot){key, a, b};
    return 0;
}

const tok_pairslot *tok_pairmap_get(const tok_pairmap *m, uint64_t key)
{
    if (!m->cap) return NULL;
    for (size_t i = pair_start(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        const tok_pairslot *s = &m->slots[i];
        if (s->key == key) return s;
        if (s->key == UINT64_MAX) return NULL;
    }
}
