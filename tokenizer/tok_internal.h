/* The tokenizer's insides, shared by its files: the loaded components
 * (normalizers, pre-tokenizers, the BPE model, added tokens, the
 * post-processor's template, decoders) and the per-call workspace.
 *
 * Sequences of normalizers, pre-tokenizers and decoders are flattened at
 * load into one array each: a Sequence of Sequences runs its members in the
 * same order either way. */
#ifndef FR_TOK_INTERNAL_H
#define FR_TOK_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "base/buf.h"
#include "tok_map.h"
#include "tok_regex.h"
#include "tokenizer.h"

/* ---- components ---- */

typedef enum { TOK_PREPEND_ALWAYS, TOK_PREPEND_FIRST, TOK_PREPEND_NEVER } tok_prepend;

typedef enum {
    TOK_NORM_NFC, TOK_NORM_NFD, TOK_NORM_NFKC, TOK_NORM_NFKD,
    TOK_NORM_PREPEND, TOK_NORM_REPLACE, TOK_NORM_STRIP, TOK_NORM_BYTE_LEVEL,
} tok_norm_kind;

typedef struct {
    tok_norm_kind kind;
    char *text;            /* Prepend's string, Replace's content */
    size_t text_len;
    tok_regex re;          /* Replace's pattern */
    int left, right;       /* Strip's sides */
} tok_norm;

typedef enum {
    TOK_PRE_SPLIT, TOK_PRE_BYTE_LEVEL, TOK_PRE_DIGITS, TOK_PRE_METASPACE,
    TOK_PRE_WHITESPACE_SPLIT, TOK_PRE_CHAR_SPLIT,
} tok_pre_kind;

typedef struct {
    tok_pre_kind kind;
    tok_regex re;                 /* Split's pattern; ByteLevel's when use_regex */
    tok_split_behavior behavior;  /* Split */
    int invert;                   /* Split */
    int add_prefix_space;         /* ByteLevel */
    int use_regex;                /* ByteLevel */
    int individual;               /* Digits */
    uint32_t ch;                  /* Metaspace's replacement, CharDelimiterSplit's delimiter */
    tok_prepend prepend;          /* Metaspace */
    int split;                    /* Metaspace */
} tok_pre;

typedef enum {
    TOK_DEC_BYTE_LEVEL, TOK_DEC_BYTE_FALLBACK, TOK_DEC_FUSE, TOK_DEC_STRIP,
    TOK_DEC_REPLACE, TOK_DEC_METASPACE, TOK_DEC_BPE,
} tok_dec_kind;

typedef struct {
    tok_dec_kind kind;
    tok_regex re;          /* Replace's pattern */
    char *text;            /* Replace's content, BPEDecoder's suffix */
    size_t text_len;
    uint32_t ch;           /* Strip's content, Metaspace's replacement */
    int start, stop;       /* Strip */
    tok_prepend prepend;   /* Metaspace */
} tok_dec;

/* An added token (tokenizer.json's added_tokens). Its content, and the
 * content after the normalizer for a normalized token, live in the string
 * arena. */
typedef struct {
    int id;
    uint32_t off, len;     /* content */
    uint32_t noff, nlen;   /* what is matched and decoded: the normalized content when normalized */
    unsigned char single_word, lstrip, rstrip, normalized, special;
} tok_added;

/* A byte trie over added tokens' contents, for leftmost-longest matching. */
typedef struct {
    tok_pairmap edges;     /* (node, byte) -> child node */
    int32_t *term;         /* per node: index of the added token ending there, or -1 */
    size_t n_nodes, cap_nodes;
    unsigned char first[256];   /* bytes that start a token */
} tok_trie;

/* The BPE model. */
typedef struct {
    tok_strmap vocab;            /* token string -> id */
    size_t n_vocab;              /* distinct strings */
    tok_pairmap merges;          /* (left id, right id) -> rank (a), merged id (b) */
    int32_t char_id[0x800];      /* id of each one-character token below U+0800, or -1 */
    int32_t byte_id[256];        /* id of the byte-level character of each byte, or -1 */
    int32_t fallback_id[256];    /* id of <0xNN>, or -1 */
    int bytes_ok;                /* byte_id complete and no prefix or suffix: raw bytes go straight in */
    int unk_id;                  /* -1: none */
    int byte_fallback, fuse_unk, ignore_merges;
    char *prefix, *suffix;       /* continuing_subword_prefix, end_of_word_suffix (NULL: none) */
    size_t prefix_len, suffix_len;
} tok_bpe;

/* Template entries: an id, or TOK_TMPL_SEQ where the encoded text goes. */
#define TOK_TMPL_SEQ (-1)

struct tok_ws;

struct fr_tokenizer {
    fr_buf str;                  /* every token string */
    int n_ids;                   /* largest id + 1 */
    uint32_t *id_off, *id_len;   /* per id: its model vocabulary string (id_len UINT32_MAX: none) */
    int32_t *id_added;           /* per id: index in added[], or -1 */
    unsigned char *id_special;   /* per id: decoding with skip_special drops it */
    size_t cap_ids;
    tok_bpe bpe;
    tok_norm *norm;
    size_t n_norm;
    tok_pre *pre;
    size_t n_pre;
    int mapped_out;              /* the last pre-tokenizer is ByteLevel: pieces reach the model unmapped */
    tok_dec *dec;
    size_t n_dec;
    int has_decoder;
    int *tmpl;                   /* the post-processor's single-sequence template */
    size_t n_tmpl;
    int has_tmpl;
    tok_added *added;
    size_t n_added;
    tok_strmap added_map;        /* content -> id */
    tok_trie raw_trie, norm_trie;
    int bos_id, eos_id;
    pthread_mutex_t pool_lock;   /* guards the idle workspaces */
    struct tok_ws **pool;
    size_t n_pool, cap_pool;
};

/* ---- the per-call workspace ---- */

/* The scratch of one pre-tokenizer stage: stages run depth first, so each
 * keeps its output alive while the stages after it consume it. */
typedef struct {
    fr_buf a, b;
    tok_segs segs, segs2;
} tok_stage;

/* A list of strings: a buffer and their spans (the decoders' currency). */
typedef struct {
    fr_buf text;
    tok_segs spans;
} tok_strlist;

/* Pre-token cache: model input bytes -> ids, cleared when full. */
typedef struct {
    uint64_t *hash;        /* per slot: the key's hash, 0 for empty */
    uint32_t *entry;       /* per slot: offset of the entry in data */
    size_t cap, count;
    fr_buf data;           /* entries: key length (u32), id count (u32), key bytes, ids */
} tok_cache;

typedef struct tok_ws {
    tok_rx_ctx rx;
    fr_buf norm_a, norm_b;       /* normalizer ping-pong */
    tok_segs added_segs;         /* added tokens in the raw text */
    tok_segs nadded_segs;        /* added tokens in a normalized piece */
    tok_segs norm_segs;          /* Replace's matches */
    tok_stage *stages;           /* one per pre-tokenizer, and the model's */
    size_t n_stages;
    fr_buf word;                 /* the model's scratch string */
    fr_buf mapped;               /* a pre-token in its byte-level spelling */
    int *ids;
    size_t n_ids, cap_ids;
    int32_t *sym;                /* BPE symbols: id, prev, next, rank of (this, next) */
    size_t cap_sym;
    uint64_t *heap;
    size_t cap_heap;
    tok_cache cache;
    tok_strlist dec[2];          /* the decoders' input and output */
} tok_ws;

/* ---- functions shared between the files ---- */

/* tok_load_model.c, tok_load_pipeline.c, tok_load_output.c: components from their JSON. */
fr_status tok_parse_normalizer(fr_tokenizer *t, const cJSON *j);
fr_status tok_parse_pre_tokenizer(fr_tokenizer *t, const cJSON *j);
fr_status tok_parse_decoder(fr_tokenizer *t, const cJSON *j);
fr_status tok_parse_post_processor(fr_tokenizer *t, const cJSON *j);
fr_status tok_parse_model(fr_tokenizer *t, const cJSON *j);
void tok_components_free(fr_tokenizer *t);
/* Appends len bytes to the string arena; their offset, or UINT32_MAX when memory ran out. */
uint32_t tok_str_add(fr_tokenizer *t, const char *s, size_t len);
/* Records id's model string (growing the id tables); -1 when memory ran out. */
int tok_set_id(fr_tokenizer *t, int id, uint32_t off, uint32_t len);
/* The JSON string of item, or NULL. */
const char *tok_json_str(const cJSON *o, const char *key);

/* tok_load_fields.c: fields the component loaders share; where names the
 * component in refusals ("pre_tokenizer.pretokenizers[1]"). */
/* A boolean field: absent or null gives def. */
fr_status tok_field_bool(const cJSON *j, const char *key, int def, const char *where, int *out);
/* A string field of exactly one character ("▁"). */
fr_status tok_field_char(const cJSON *j, const char *key, const char *where, uint32_t *out);
/* The "pattern" object, {"String": s} or {"Regex": r}, compiled. */
fr_status tok_field_pattern(const cJSON *j, const char *where, tok_regex *re);
/* Reads one component (a Sequence's item included) at nesting depth. */
typedef fr_status (*tok_parse_fn)(fr_tokenizer *t, const cJSON *j, const char *where, int depth);
/* A Sequence: parse on each item of the list j[key], nesting bounded. */
fr_status tok_parse_sequence(fr_tokenizer *t, const cJSON *j, const char *key, const char *where, int depth,
                             tok_parse_fn parse);

/* tok_added.c */
fr_status tok_parse_added(fr_tokenizer *t, const cJSON *list);
fr_status tok_build_tries(fr_tokenizer *t);
void tok_trie_free(tok_trie *tr);
/* The added-token matches of text (the raw or the normalized trie): a
 * segment list over text where a matched token's segment has match = its
 * added index + 1, text between them match = 0, as tokenizers'
 * AddedVocabulary::find_matches (single_word, lstrip, rstrip applied). */
fr_status tok_added_split(const fr_tokenizer *t, const tok_trie *tr, const char *s, size_t n, tok_segs *out);

/* tok_normalize.c: runs the normalizers over s; *out is s itself or one of
 * ws's normalizer buffers. */
fr_status tok_normalize(const fr_tokenizer *t, tok_ws *ws, const char *s, size_t n, const char **out,
                        size_t *out_len);

/* Normal form k (NFC, NFD, NFKC, NFKD) of s appended to dst: 1 when s is
 * in it already (dst untouched), 0 when dst holds it (*st: the status). */
int tok_unicode_form(tok_norm_kind k, const char *s, size_t n, fr_buf *dst, fr_status *st);

/* tok_pretok.c: pre-tokenizes s from stage k on and feeds the model;
 * at_start: s begins at offset 0 of the original text. */
fr_status tok_pretok_run(const fr_tokenizer *t, tok_ws *ws, size_t k, const char *s, size_t n, int at_start);

/* tok_bpe.c: the ids of one pre-token, appended to ws->ids. mapped: s is
 * raw bytes still to be read through ByteLevel's byte-to-character table. */
fr_status tok_bpe_word(const fr_tokenizer *t, tok_ws *ws, const char *s, size_t n, int mapped);
int tok_ws_push_id(tok_ws *ws, int id);
void tok_cache_free(tok_cache *c);

/* tok_bytelevel.c: ByteLevel's byte-to-character table (GPT-2's). */
uint32_t tok_byte_char(unsigned char b);
/* The byte of a byte-level character, or -1. */
int tok_char_byte(uint32_t cp);
/* Appends the byte-level spelling of s to out. */
void tok_bytelevel_map(fr_buf *out, const char *s, size_t n);

/* tok_workspace.c */
tok_ws *tok_ws_get(const fr_tokenizer *t);
void tok_ws_put(const fr_tokenizer *t, tok_ws *ws);
void tok_ws_free(tok_ws *ws);

/* tok_decode.c: the decoded text of ids into out. */
fr_status tok_decode_into(const fr_tokenizer *t, const int *ids, size_t n, int skip_special, fr_buf *out);

/* tok_config.c: tokenizer_config.json. */
fr_status tok_apply_config(fr_tokenizer *t, const char *json, size_t len, const char *label);

#endif
