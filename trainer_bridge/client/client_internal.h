/* What client.c shares with client_nccl.c (the NCCL weight group of the C
 * client); not part of the public API. */
#ifndef FR_CLIENT_INTERNAL_H
#define FR_CLIENT_INTERNAL_H

#include "trainer_bridge/client/client.h"

/* Sends m and waits for its reply of type want (client.c's call). */
fr_status fr_client_call_(fr_client *c, const fr_msg *m, fr_msg_type want, fr_msg *reply);
fr_status fr_client_send_(fr_client *c, const fr_msg *m);
/* Receives at most one message within wait_ms: *got 1 and *reply when it
 * is of type want; an error naming no request fails (the server's answer to
 * `what`); anything else is kept for the caller's later reads. */
fr_status fr_client_take_(fr_client *c, int wait_ms, fr_msg_type want, const char *what, fr_msg *reply, int *got);
/* A server refusal of an update message, with its code in the text. */
fr_status fr_client_refused_(fr_status st);
/* Fills an update_weights_begin with the tensors' names, dtypes and shapes,
 * its version and bucket size (b->tensors allocated, even on a refusal of a
 * tensor: the caller frees it); `what` names the call in messages. */
fr_status fr_client_begin_tensors_(fr_msg_update_begin *b, const fr_client_tensor *tensors, int n, uint64_t version,
                                   uint64_t bucket, const char *what);
/* After a failed pipelined exchange: sends a stats request and reads until
 * its reply, dropping the server's answers to earlier update and group
 * messages on the way (it answers in order, so none is left after it), so
 * that they cannot be taken for the answers to the next call. */
fr_status fr_client_settle_(fr_client *c, int wait_ms);
int fr_client_timeout_(const fr_client *c);
/* Where the client keeps its NCCL group. */
void **fr_client_nccl_slot_(fr_client *c);
/* Ends and frees the group in *slot (client_nccl.c); NULL-safe. */
void fr_client_nccl_free_(void **slot);

#endif
