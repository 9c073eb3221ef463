/* The samples' text (docs/sampling.md, "Stop strings"): a text state per
 * sample of a request that gives stop strings or asks for text
 * (rollout/engine/stop_strings.h), fed each accepted token on the host, so
 * stop strings end samples alike on every backend and every rank of an
 * engine. Samples of other requests carry none and pay nothing. */
#include "rollout/engine/scheduler_internal.h"

#include <stdlib.h>
#include <string.h>

int sch_text_wanted(const fr_request_spec *spec) { return spec->with_text || spec->stop_strings.n > 0; }

fr_status sch_text_check(const fr_scheduler *sch, const fr_request_spec *spec)
{
    if (!sch_text_wanted(spec) || sch->cfg.tokenizer) return FR_OK;
    return fr_fail(FR_EINVAL, "request %llu: %s a tokenizer, and this engine has none", (unsigned long long)spec->id,
                   spec->stop_strings.n > 0 ? "stop strings need" : "text needs");
}

int sch_text_open(fr_scheduler *sch, req *r, const fr_request_spec *spec)
{
    r->with_text = spec->with_text != 0;
    if (!sch_text_wanted(spec)) return 0;
    for (int i = 0; i < r->n; i++)
        if (fr_sample_text_new(sch->cfg.tokenizer, &spec->stop_strings, &r->samples[i].text)) return -1;
    return 0;
}

fr_finish_reason sch_text_token(fr_scheduler *sch, sample *x, int tok)
{
    if (!x->text) return FR_FINISH_NONE;
    int matched;
    /* Before min_tokens no stop ends a sample: neither a stop id (barred
     * from the draws) nor a stop string (passed over in the text). */
    if (fr_sample_text_push(x->text, tok, x->n >= x->r->min_tokens, &matched)) return FR_FINISH_ERROR;
    size_t len, stable;
    const char *text = fr_sample_text_get(x->text, &len, &stable);
    if (stable > x->text_sent && sch->cfg.on_text && x->r->with_text)   /* stop strings alone: the result's text only */
        sch->cfg.on_text(sch->cfg.user, x->r->id, (int)x->stream, x->n - 1, text + x->text_sent,
                         stable - x->text_sent);
    if (stable > x->text_sent) x->text_sent = stable;
    if (matched < 0) return FR_FINISH_NONE;
    x->stop_string = matched + 1;
    return FR_FINISH_STOP;
}

void sch_text_result(sample *x, fr_sample_result *res)
{
    if (!x->text) return;
    fr_sample_text_finish(x->text);   /* a failure leaves what was decoded: the result keeps that */
    size_t len;
    const char *text = fr_sample_text_get(x->text, &len, NULL);
    res->text = malloc(len + 1);
    if (res->text) {
        memcpy(res->text, text, len + 1);
        res->text_len = len;
    }
    res->stop_string = x->stop_string;
    fr_sample_text_free(&x->text);
}
