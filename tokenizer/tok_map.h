/* Hash tables of the tokenizer: strings to ids (the vocabulary, the added
 * tokens) and 64-bit keys to a pair of 32-bit values (BPE merge ranks, trie
 * edges). Open addressing with linear probing at load factor <= 1/2: the
 * vocabulary lookups sit in the encoder's inner loop, and a probe that
 * stays in one cache line beats a chained table there.
 *
 * Keys of a tok_strmap are not copied: the table stores their offset and
 * length in an arena the caller owns (the tokenizer's string buffer), and
 * every call takes the arena's current base, so the arena may grow between
 * calls. Inserting a key that is present replaces its value: a vocabulary
 * that lists a token twice keeps the last id, as a JSON object read into a
 * hash map does in `tokenizers`. */
#ifndef FR_TOK_MAP_H
#define FR_TOK_MAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t hash;    /* upper bits of the key's hash; 0 marks an empty slot */
    uint32_t len;
    uint32_t off;     /* the key's offset in the arena */
    int32_t value;
} tok_strslot;

typedef struct {
    tok_strslot *slots;
    size_t cap;       /* a power of two */
    size_t count;
} tok_strmap;

typedef struct {
    uint64_t key;     /* UINT64_MAX marks an empty slot */
    uint32_t a;
    int32_t b;
} tok_pairslot;

typedef struct {
    tok_pairslot *slots;
    size_t cap;
    size_t count;
} tok_pairmap;

uint64_t tok_hash(const void *p, size_t len);

/* 0 on success, -1 when memory ran out. */
int tok_strmap_init(tok_strmap *m, size_t expected);
int tok_strmap_put(tok_strmap *m, const char *arena, uint32_t off, uint32_t len, int32_t value);
/* The value of key, or -1. */
int32_t tok_strmap_get(const tok_strmap *m, const char *arena, const char *key, size_t len);
void tok_strmap_free(tok_strmap *m);

int tok_pairmap_init(tok_pairmap *m, size_t expected);
/* Sets key's values (replacing them when key is present). */
int tok_pairmap_put(tok_pairmap *m, uint64_t key, uint32_t a, int32_t b);
/* The slot of key, or NULL. */
const tok_pairslot *tok_pairmap_get(const tok_pairmap *m, uint64_t key);
void tok_pairmap_free(tok_pairmap *m);

static inline uint64_t tok_pair_key(int32_t a, int32_t b)
{
    return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}

#endif
