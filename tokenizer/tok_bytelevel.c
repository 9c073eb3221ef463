/* ByteLevel's alphabet: every byte stands for one printable character, so
 * a byte-level vocabulary spells any byte string. Bytes that print as
 * themselves in Latin-1 (! to ~, ¡ to ¬, ® to ÿ) keep their code point; the
 * others, in byte order, take U+0100 onwards (space is U+0120, 'Ġ'). */
#include <pthread.h>

#include "tok_internal.h"
#include "tok_utf8.h"

static uint32_t byte_char[256];
static char byte_utf8[256][2];     /* every character of the alphabet is 1 or 2 UTF-8 bytes */
static unsigned char byte_utf8_len[256];
static int16_t char_byte[0x144];    /* the alphabet ends at U+0143 */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static int prints_as_itself(int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

static void build(void)
{
    uint32_t next = 0x100;
    for (int i = 0; i < 0x144; i++) char_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        byte_char[b] = prints_as_itself(b) ? (uint32_t)b : next++;
        char tmp[4];
        byte_utf8_len[b] = (unsigned char)tok_utf8_put(byte_char[b], tmp);
        byte_utf8[b][0] = tmp[0];
        byte_utf8[b][1] = tmp[1];
        char_byte[byte_char[b]] = (int16_t)b;
    }
}

uint32_t tok_byte_char(unsigned char b)
{
    pthread_once(&once, build);
    return byte_char[b];
}

int tok_char_byte(uint32_t cp)
{
    pthread_once(&once, build);
    return cp < 0x144 ? char_byte[cp] : -1;
}

void tok_bytelevel_map(fr_buf *out, const char *s, size_t n)
{
    pthread_once(&once, build);
    if (fr_buf_reserve(out, 2 * n) != 0) return;
    char *o = out->data + out->len;
    for (size_t i = 0; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        o[0] = byte_utf8[b][0];
        o[1] = byte_utf8[b][1];
        o += byte_utf8_len[b];
    }
    out->len = (size_t)(o - out->data);
    out->data[out->len] = '\0';
}
