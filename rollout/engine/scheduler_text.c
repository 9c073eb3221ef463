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
        if (fr_sample_text_new(sch->cfg.tokenizer, &spec->stop_strings, !spec->keep_special, &r->samples[i].text)) return -1;
    /* A continuation's text is what its own tokens add to the whole
     * sample's text: the continued tokens go through the detokenizer first
     * (no stop string ends them), so a stop string across the seam matches,
     * and everything they decoded to (the partial sample's text) is left
     * out. A character split at the seam comes out whole here, where the
     * partial sample's text ended it with U+FFFD. */
    for (int i = 0; i < spec->n_continue; i++) {
        int matched;
        if (fr_sample_text_push(r->samples[0].text, spec->continue_tokens[i], 0, &matched)) return -1;
    }
    if (spec->n_continue > 0) {
        fr_sample_text_get(r->samples[0].text, &r->samples[0].text_from, NULL);
        r->samples[0].text_sent = r->samples[0].text_from;
    }
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
    /* a stop string that began in the continued tokens' text: nothing of
     * this request's comes before it */
    const size_t from = x->text_from < len ? x->text_from : len;
    text += from;
    len -= from;
    res->text = malloc(len + 1);
    if (res->text) {
        memcpy(res->text, text, len + 1);
        res->text_len = len;
    }
    res->stop_string = x->stop_string;
    fr_sample_text_free(&x->text);
}
