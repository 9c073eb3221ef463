#include "rollout/engine/request.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *fr_finish_reason_name(fr_finish_reason r)
{
    switch (r) {
    case FR_FINISH_STOP: return "stop";
    case FR_FINISH_LENGTH: return "length";
    case FR_FINISH_ABORT: return "abort";
    case FR_FINISH_ERROR: return "error";
    default: return "none";
    }
}

void fr_sample_result_free(fr_sample_result *r)
{
    if (!r) return;
    free(r->tokens);
    free(r->logprobs);
    free(r->versions);
    free(r->kl);
    memset(r, 0, sizeof *r);
}

fr_status fr_request_spec_check(const fr_request_spec *r, int vocab)
{
    if (!r) return fr_fail(FR_EINVAL, "request: NULL");
    if (!r->prompt || r->n_prompt < 1) return fr_fail(FR_EINVAL, "request %llu: the prompt is empty",
                                                      (unsigned long long)r->id);
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= vocab)
            return fr_fail(FR_EINVAL, "request %llu: prompt token %d is id %d, outside the vocabulary of %d",
                           (unsigned long long)r->id, i, r->prompt[i], vocab);
    if (r->n < 1) return fr_fail(FR_EINVAL, "request %llu: n must be >= 1 (got %d)", (unsigned long long)r->id, r->n);
    if (r->max_tokens < 1)
        return fr_fail(FR_EINVAL, "request %llu: max_tokens must be >= 1 (got %d)", (unsigned long long)r->id,
                       r->max_tokens);
    if (r->n_stop < 0 || (r->n_stop > 0 && !r->stop_ids))
        return fr_fail(FR_EINVAL, "request %llu: bad stop ids", (unsigned long long)r->id);
    for (int i = 0; i < r->n_stop; i++)
        if (r->stop_ids[i] < 0 || r->stop_ids[i] >= vocab)
            return fr_fail(FR_EINVAL, "request %llu: stop id %d is outside the vocabulary of %d",
                           (unsigned long long)r->id, r->stop_ids[i], vocab);
    if (r->forced && r->n_forced < 1)
        return fr_fail(FR_EINVAL, "request %llu: forced tokens given but n_forced is %d", (unsigned long long)r->id,
                       r->n_forced);
    for (int i = 0; r->forced && i < r->n_forced; i++)
        if (r->forced[i] < 0 || r->forced[i] >= vocab)
            return fr_fail(FR_EINVAL, "request %llu: forced token %d (%d) is outside the vocabulary of %d",
                           (unsigned long long)r->id, i, r->forced[i], vocab);
    fr_status st = fr_sampling_params_check(&r->params, vocab);
    if (st) {
        char msg[512];   /* the message is rewritten below: copy it first */
        snprintf(msg, sizeof msg, "%s", fr_last_error());
        return fr_fail(st, "request %llu: %s", (unsigned long long)r->id, msg);
    }
    return FR_OK;
}
