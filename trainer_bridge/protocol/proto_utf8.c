/* UTF-8 checks and escaping for the strings of the protocol
 * (trainer_bridge/protocol/protocol.h, docs/protocol.md "Strings"): every
 * string on the wire is UTF-8, so a strict msgpack reader (one that turns
 * str into text) can read every message either side sends. */
#include <stdio.h>
#include <string.h>

#include "trainer_bridge/protocol/protocol.h"

/* The length of the well-formed UTF-8 sequence at s (RFC 3629: no overlong
 * forms, no surrogates, nothing above U+10FFFF), or 0 when there is none. */
static size_t seq_len(const unsigned char *s, size_t n)
{
    const unsigned char b = s[0];
    if (b < 0x80) return 1;
    size_t len;
    unsigned lo = 0x80, hi = 0xbf;   /* the allowed range of the second byte */
    if (b >= 0xc2 && b <= 0xdf) len = 2;
    else if (b >= 0xe0 && b <= 0xef) {
        len = 3;
        if (b == 0xe0) lo = 0xa0;        /* overlong */
        else if (b == 0xed) hi = 0x9f;   /* surrogates */
    } else if (b >= 0xf0 && b <= 0xf4) {
        len = 4;
        if (b == 0xf0) lo = 0x90;        /* overlong */
        else if (b == 0xf4) hi = 0x8f;   /* above U+10FFFF */
    } else return 0;
    if (n < len || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if ((s[i] & 0xc0) != 0x80) return 0;
    return len;
}

int fr_utf8_valid(const void *data, size_t n)
{
    const unsigned char *s = data;
    for (size_t i = 0; i < n;) {
        size_t k = seq_len(s + i, n - i);
        if (!k) return 0;
        i += k;
    }
    return 1;
}

size_t fr_utf8_escape(const void *data, size_t n, char *out, size_t cap)
{
    const unsigned char *s = data;
    size_t o = 0;
    if (!out || cap == 0) return 0;
    for (size_t i = 0; i < n;) {
        size_t k = seq_len(s + i, n - i);
        if (k && s[i] != 0) {
            if (o + k >= cap) break;
            memcpy(out + o, s + i, k);
            o += k;
            i += k;
        } else {
            if (o + 4 >= cap) break;
            snprintf(out + o, cap - o, "\\x%02x", s[i]);
            o += 4;
            i++;
        }
    }
    out[o] = 0;
    return o;
}
