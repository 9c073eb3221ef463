/* Stop strings and the text of a sample as it is drawn (docs/sampling.md,
 * "Stop strings").
 *
 * A stop string ends a sample as soon as the sample's decoded text contains
 * it, wherever the token boundaries fall: a stop string may span tokens, and
 * a character of several bytes completes only with its last byte's token.
 * The text is the sample's tokens decoded with special tokens skipped, as
 * the tokenizer's incremental detokenizer (tokenizer/tokenizer.h, fr_detok)
 * hands it out, so text is never cut inside a UTF-8 character.
 *
 * Two layers: the matcher (fr_stop_matcher: text in, where the first stop
 * string ends out, needing no tokenizer) and a sample's text state
 * (fr_sample_text: the detokenizer, the text so far, the matcher). The
 * scheduler keeps one fr_sample_text per sample whose request asks for
 * text or stop strings; anything else that streams a sample's text (a
 * server's HTTP side, say) may keep its own:
 *
 *     fr_sample_text *t;
 *     fr_sample_text_new(tok, &stops, 1, &t);
 *     for each token: fr_sample_text_push(t, token, 1, &matched);   // matched >= 0: stop now
 *     text = fr_sample_text_get(t, &len, &stable);   // send text[sent, stable) to a stream
 *     at an end without a match: fr_sample_text_finish(t);      // then stable == len
 *     fr_sample_text_free(&t);
 */
#ifndef FR_STOP_STRINGS_H
#define FR_STOP_STRINGS_H

#include <stddef.h>

#include "base/fr_status.h"
#include "tokenizer/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_MAX_STOP_STRINGS 32        /* stop strings of one request */
#define FR_MAX_STOP_STRING_BYTES 1024 /* bytes of one stop string */

/* A request's stop strings: n of them, each non-empty UTF-8 without NUL,
 * at most FR_MAX_STOP_STRING_BYTES bytes. include: the matched stop string
 * stays at the end of the text (by default the text ends where it starts,
 * as vLLM's include_stop_str_in_output false). */
typedef struct {
    const char *const *s;
    int n;
    int include;
} fr_stop_strings;

/* FR_EINVAL naming the string (by its index) when one is empty, holds NUL,
 * is not UTF-8 or is too long, or there are more than FR_MAX_STOP_STRINGS.
 * what names the owner in the message ("request 7"). */
fr_status fr_stop_strings_check(const fr_stop_strings *stops, const char *what);

/* The matcher: text fed to it in pieces, in order, it says where the first
 * stop string ends. One automaton per stop string (Knuth-Morris-Pratt) keeps
 * the longest end of the text that begins that stop string, so each byte
 * costs the same whatever the strings and the text, and the answer does not
 * depend on how the text was cut into pieces: the match is the shortest
 * prefix of the whole text that holds a stop string (of matches ending at
 * the same byte, the longest). */
typedef struct fr_stop_matcher fr_stop_matcher;

/* stops are copied; FR_EINVAL as fr_stop_strings_check. */
fr_status fr_stop_matcher_new(const fr_stop_strings *stops, fr_stop_matcher **out);
void fr_stop_matcher_free(fr_stop_matcher **m);
/* Feeds bytes[0, n): the index of the stop string whose match ends first
 * in them, *used (may be NULL) the bytes up to and including that end; -1
 * (and *used n) when none ends in them. After a match, feeding again
 * continues after the match's end (the caller usually stops there). */
int fr_stop_matcher_feed(fr_stop_matcher *m, const char *bytes, size_t n, size_t *used);
/* How many of the last bytes fed might still become the start of a stop
 * string's match: the longest end of the text that is a proper prefix of
 * one. A stream holds them back. On UTF-8 text they start on a character's
 * first byte (stop strings are UTF-8). */
size_t fr_stop_matcher_holdback(const fr_stop_matcher *m);
/* The length in bytes of stop string i. */
size_t fr_stop_matcher_len(const fr_stop_matcher *m, int i);

/* A sample's text state. */
typedef struct fr_sample_text fr_sample_text;

/* A state for one sample, decoding with tok (which must outlive it) and
 * matching stops (copied; NULL or n 0: text alone, no matching);
 * skip_special 1 leaves the special tokens out of the text (stop strings
 * then never match them), 0 decodes them as their content. */
fr_status fr_sample_text_new(const fr_tokenizer *tok, const fr_stop_strings *stops, int skip_special,
                             fr_sample_text **out);
void fr_sample_text_free(fr_sample_text **t);

/* The sample's next token. *matched: the index of the stop string its text
 * completed, or -1. After a match the text is final: cut where the stop
 * string starts (or after it, with include), and further pushes are
 * refused (FR_EINVAL). may_stop 0 passes over stop strings the token's
 * text completes (a request's min_tokens: its first tokens never stop a
 * sample); the text after them is still searched. */
fr_status fr_sample_text_push(fr_sample_text *t, int token, int may_stop, int *matched);

/* The sample ended without a match (length, a stop token, an abort): what
 * the detokenizer held back (an incomplete character, as U+FFFD) joins the
 * text, and all of it is final. Idempotent; nothing to do after a match. */
fr_status fr_sample_text_finish(fr_sample_text *t);

/* The text so far (NUL-terminated, *len bytes; "" when none), valid until
 * the next call on t, and in *stable (may be NULL) how many of its first
 * bytes are final: they never change and never become part of a stop
 * string, so a stream may send them. Before the end, the bytes after
 * *stable are what might still start a stop string; after a match or
 * fr_sample_text_finish, *stable is *len. */
const char *fr_sample_text_get(const fr_sample_text *t, size_t *len, size_t *stable);

/* The index of the stop string that matched, -1 while none has. */
int fr_sample_text_matched(const fr_sample_text *t);

#ifdef __cplusplus
}
#endif

#endif
