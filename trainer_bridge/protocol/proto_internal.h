/* Shared by the codec's files (proto_common.c, proto_encode.c,
 * proto_decode.c); not part of the public API. */
#ifndef FR_PROTO_INTERNAL_H
#define FR_PROTO_INTERNAL_H

#include "trainer_bridge/protocol/protocol.h"

#define FR_PROTO_MAX_SAMPLES 65536   /* "n" of a generate */

/* The type of a wire name, FR_MSG_NONE when unknown. */
fr_msg_type fr_proto_type_from_name(const char *s, size_t len);
/* 1 and *out for "stop", "length", "abort", "error"; 0 otherwise. */
int fr_proto_finish_from_name(const char *s, size_t len, fr_wire_finish *out);
/* 1 and *out for "f32", "bf16", "f16"; 0 otherwise. */
int fr_proto_dtype_from_name(const char *s, size_t len, fr_dtype *out);
/* 1 and *out for "begin", "bucket", "commit", "abort"; 0 otherwise. */
int fr_proto_stage_from_name(const char *s, size_t len, fr_update_stage *out);
/* 1 and *out for "joining", "closed"; 0 otherwise. */
int fr_proto_nccl_state_from_name(const char *s, size_t len, fr_nccl_state *out);
/* The value checks of a message (ranges, required arrays), the same for
 * encoding and decoding: FR_EFORMAT naming the field. */
fr_status fr_proto_check(const fr_msg *m);
/* Bytes of a done's routed experts: n_tokens x layers x k x width. */
uint64_t fr_proto_route_bytes(const fr_msg_done *d);

#endif
