/* Regular expressions of tokenizer.json (Split and Replace patterns), run by
 * PCRE2 with its JIT, and the match lists `tokenizers` builds from them.
 *
 * `tokenizers` compiles its patterns with Oniguruma. The two engines agree
 * on the backtracking semantics (leftmost match, first alternative that
 * matches) and on \p{..} classes, but not on every escape, so a pattern is
 * translated before PCRE2 compiles it (UTF mode, Unicode properties):
 *   \s, \S   Oniguruma's White_Space set, spelled out (PCRE2 10.42 also
 *            counts U+180E as a space)
 *   \w, \W   letters, marks, numbers and connector punctuation
 *   \h, \H   hexadecimal digits (PCRE2 reads them as horizontal space)
 *   \uHHHH   \x{HHHH}
 * A match list covers its subject: the pieces between matches and the
 * matches, in order, as tokenizers' Pattern::find_matches returns them
 * (an empty subject gives one empty non-match). */
#ifndef FR_TOK_REGEX_H
#define FR_TOK_REGEX_H

#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "base/fr_status.h"

typedef struct {
    pcre2_code *code;
} tok_regex;

/* Per-thread match state: PCRE2's match data and JIT stack. */
typedef struct {
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
} tok_rx_ctx;

/* One piece of a match list: bytes [s, e) of the subject, a match or not. */
typedef struct {
    uint32_t s, e;
    uint32_t match;
} tok_seg;

typedef struct {
    tok_seg *v;
    size_t n, cap;
} tok_segs;

/* Compiles pattern (len bytes), a regular expression in Oniguruma's syntax
 * or, when literal, a string to find as it is. `what` names the component
 * in a refusal ("pre_tokenizer Split"). */
fr_status tok_regex_compile(tok_regex *re, const char *pattern, size_t len, int literal, const char *what);
void tok_regex_free(tok_regex *re);

/* The PCRE2 spelling of an Oniguruma pattern (for tests): a malloc'd
 * string, or NULL with a message when the pattern uses what cannot be
 * translated. */
char *tok_regex_translate(const char *pattern, size_t len, size_t *out_len);

fr_status tok_rx_ctx_init(tok_rx_ctx *c);
void tok_rx_ctx_free(tok_rx_ctx *c);

/* Appends a segment; -1 when memory ran out. */
int tok_segs_push(tok_segs *l, uint32_t s, uint32_t e, uint32_t match);

/* The match list of re over s[0..n) (valid UTF-8), replacing l's contents. */
fr_status tok_regex_matches(const tok_regex *re, tok_rx_ctx *c, const char *s, size_t n, tok_segs *l);

/* The match list where every character for which pred is true is a match
 * of its own (tokenizers' pattern of a char predicate). */
fr_status tok_char_matches(int (*pred)(uint32_t cp, uint32_t arg), uint32_t arg, const char *s, size_t n,
                           tok_segs *l);

/* How a Split turns a match list into pieces (tokenizers'
 * SplitDelimiterBehavior). */
typedef enum {
    TOK_SPLIT_REMOVED,
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_MERGED_PREV,
    TOK_SPLIT_MERGED_NEXT,
    TOK_SPLIT_CONTIGUOUS,
} tok_split_behavior;

/* Rewrites l in place into the pieces to keep, in order: each segment's
 * `match` is then 1 for a piece that is dropped (a Removed delimiter). */
void tok_segs_apply(tok_segs *l, tok_split_behavior b, int invert);

#endif
