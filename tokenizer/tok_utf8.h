/* UTF-8 and the few Unicode predicates the tokenizer needs in its own code
 * (regular expressions get theirs from PCRE2, normal forms from utf8proc).
 * The predicates follow Rust's `char` methods, which `tokenizers` calls:
 * is_whitespace is the White_Space property, is_numeric the N categories. */
#ifndef FR_TOK_UTF8_H
#define FR_TOK_UTF8_H

#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"

/* The length of the longest valid UTF-8 prefix of s (n when all of it is
 * valid): the rules of Rust's str, so no overlong forms, surrogates or code
 * points past U+10FFFF. */
size_t tok_utf8_valid_prefix(const char *s, size_t n);

/* Decodes the character at s (valid UTF-8, at least one byte): its length. */
static inline int tok_utf8_next(const char *s, uint32_t *cp)
{
    const unsigned char *u = (const unsigned char *)s;
    if (u[0] < 0x80) { *cp = u[0]; return 1; }
    if (u[0] < 0xE0) { *cp = ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F); return 2; }
    if (u[0] < 0xF0) {
        *cp = ((uint32_t)(u[0] & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
        return 3;
    }
    *cp = ((uint32_t)(u[0] & 0x07) << 18) | ((uint32_t)(u[1] & 0x3F) << 12) | ((uint32_t)(u[2] & 0x3F) << 6) |
          (u[3] & 0x3F);
    return 4;
}

/* The length of the character that starts with byte b (1 for a stray
 * continuation byte, so a scan always advances). */
static inline int tok_utf8_len(unsigned char b) { return b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

/* Writes cp (a valid scalar value) to out: its length, 1 to 4. */
int tok_utf8_put(uint32_t cp, char *out);

/* The start of the last character of s[0..n) (n > 0, valid UTF-8). */
size_t tok_utf8_last_start(const char *s, size_t n);

/* Appends bytes to out as Rust's String::from_utf8_lossy does: each maximal
 * invalid subsequence becomes one U+FFFD. */
void tok_utf8_lossy(fr_buf *out, const char *s, size_t n);

int tok_is_whitespace(uint32_t cp);   /* White_Space: Rust char::is_whitespace */
int tok_is_numeric(uint32_t cp);      /* Nd, Nl, No: Rust char::is_numeric */
int tok_is_word(uint32_t cp);         /* \w of Rust's regex crate: letters, marks, Nd, Nl, Pc, joiners */

#endif
