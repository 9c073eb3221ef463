/* Frames judged without being unpacked: the lengths a msgpack value
 * declares against the bytes it has (so no 8-byte frame makes msgpack-c
 * reserve gigabytes), the bound on arrays the server accepts, and the
 * best-effort peeks at `type` and `request_id` for error replies
 * (trainer_bridge/protocol/protocol.h). */
#include <msgpack.h>
#include <stdint.h>
#include <string.h>

#include "trainer_bridge/protocol/proto_decode.h"

/* Walks the msgpack value in data[0, len) without building it and says
 * whether its declared lengths are plausible: an array or map announcing far
 * more elements than bytes are left, or a string far longer than the frame,
 * would make msgpack-c reserve memory for it up front (8 bytes could ask for
 * gigabytes). "Far" is SLACK beyond the frame: a frame merely cut short is
 * left to the unpacker, which says so. Nesting deeper than 64 is refused.
 * 1: plausible (the unpacker still judges everything), 0: not. */
enum { SLACK = 1 << 20 };

/* Also: no array declares more than max_array entries (*longest: the
 * longest one declared, when not NULL). */
static int lengths_fit_max(const uint8_t *p, size_t len, uint64_t max_array, uint64_t *longest)
{
    size_t at = 0, pending[65];
    int depth = 0;
    pending[0] = 1;   /* the top-level value */
    while (depth >= 0) {
        if (pending[depth] == 0) {
            depth--;
            continue;
        }
        pending[depth]--;
        if (at >= len) return 1;   /* cut short: the unpacker reports it */
        const uint8_t b = p[at++];
        uint64_t n = 0, items = 0;   /* payload bytes to skip, child values to read */
        size_t w = 0;                /* bytes of the length field */
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) continue;        /* fixint, nil, bool */
        if ((b & 0xe0) == 0xa0) n = b & 0x1f;                                                /* fixstr */
        else if ((b & 0xf0) == 0x90) {                                                       /* fixarray */
            items = b & 0x0f;
            if (items > max_array) return 0;
        }
        else if ((b & 0xf0) == 0x80) items = 2 * (uint64_t)(b & 0x0f);                      /* fixmap */
        else {
            switch (b) {
            case 0xcc: case 0xd0: n = 1; break;
            case 0xcd: case 0xd1: n = 2; break;
            case 0xca: case 0xce: case 0xd2: n = 4; break;
            case 0xcb: case 0xcf: case 0xd3: n = 8; break;
            case 0xd4: n = 2; break;   /* fixext 1..16: type byte + data */
            case 0xd5: n = 3; break;
            case 0xd6: n = 5; break;
            case 0xd7: n = 9; break;
            case 0xd8: n = 17; break;
            case 0xc4: case 0xd9: w = 1; break;   /* bin8, str8 */
            case 0xc5: case 0xda: w = 2; break;
            case 0xc6: case 0xdb: w = 4; break;
            case 0xc7: w = 1; break;               /* ext8/16/32: length, then type byte */
            case 0xc8: w = 2; break;
            case 0xc9: w = 4; break;
            case 0xdc: case 0xde: w = 2; break;    /* array16, map16 */
            case 0xdd: case 0xdf: w = 4; break;    /* array32, map32 */
            default: return 1;                     /* 0xc1 (never used): the unpacker reports it */
            }
            if (w) {
                if (len - at < w) return 1;
                uint64_t v = 0;
                for (size_t i = 0; i < w; i++) v = v << 8 | p[at + i];
                at += w;
                if (b == 0xdc || b == 0xdd) {
                    items = v;
                    if (longest && v > *longest) *longest = v;
                    if (v > max_array) return 0;
                }
                else if (b == 0xde || b == 0xdf) items = 2 * v;
                else n = v + (b >= 0xc7 && b <= 0xc9 ? 1 : 0);
            }
        }
        if (n > len - at) return n - (len - at) <= SLACK;
        at += (size_t)n;
        if (items) {
            /* each element takes a byte at least; a container merely cut short
             * is walked on (its elements may still declare huge lengths) */
            if (items > len - at && items - (len - at) > SLACK) return 0;
            if (depth == 64) return 0;
            pending[++depth] = (size_t)items;
        }
    }
    return 1;
}


int fr_proto_lengths_fit(const void *data, size_t len) { return lengths_fit_max(data, len, UINT64_MAX, NULL); }

int fr_msg_peek_request_id(const void *data, size_t len, uint64_t *id)
{
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    int found = 0;
    size_t off = 0;
    if (data && len && fr_proto_lengths_fit(data, len) && msgpack_unpack_next(&u, data, len, &off) == MSGPACK_UNPACK_SUCCESS &&
        u.data.type == MSGPACK_OBJECT_MAP) {
        const msgpack_object *o = fr_dec_find(&u.data.via.map, "request_id");
        if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
            if (id) *id = o->via.u64;
            found = 1;
        }
    }
    msgpack_unpacked_destroy(&u);
    return found;
}

fr_msg_type fr_msg_peek_type(const void *data, size_t len)
{
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    fr_msg_type t = FR_MSG_NONE;
    size_t off = 0;
    if (data && len && fr_proto_lengths_fit(data, len) && msgpack_unpack_next(&u, data, len, &off) == MSGPACK_UNPACK_SUCCESS &&
        u.data.type == MSGPACK_OBJECT_MAP) {
        const msgpack_object *o = fr_dec_find(&u.data.via.map, "type");
        if (o && o->type == MSGPACK_OBJECT_STR) t = fr_proto_type_from_name(o->via.str.ptr, o->via.str.size);
    }
    msgpack_unpacked_destroy(&u);
    return t;
}

fr_status fr_msg_check_bounds(const void *data, size_t len, uint64_t max_array)
{
    uint64_t longest = 0;
    if (!data || len == 0) return FR_OK;   /* the decoder says what is wrong */
    if (lengths_fit_max(data, len, max_array, &longest)) return FR_OK;
    if (longest > max_array)
        return BAD("message: an array declares %llu entries; no message this server accepts holds more than %llu",
                   (unsigned long long)longest, (unsigned long long)max_array);
    return BAD("message: frame 0 (%zu bytes) declares lengths far beyond its bytes, or nests deeper than 64", len);
}
