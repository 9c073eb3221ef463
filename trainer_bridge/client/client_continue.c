/* Continuing a partial sample (trainer_bridge/client/client.h,
 * fr_client_continuation; docs/sampling.md, "Continuing a sample"): the
 * generate that makes the rest of a sample an abort or a pause ended. */
#include "trainer_bridge/client/client_internal.h"

#include <stdlib.h>
#include <string.h>

/* n ints of a then m of b in one new array (NULL: out of memory). */
static int *concat(const int *a, int n, const int *b, int m)
{
    int *v = malloc(sizeof(int) * (size_t)(n + m > 0 ? n + m : 1));
    if (!v) return NULL;
    if (n > 0) memcpy(v, a, sizeof(int) * (size_t)n);
    if (m > 0) memcpy(v + n, b, sizeof(int) * (size_t)m);
    return v;
}

fr_status fr_client_continuation(const fr_msg_generate *g, const fr_client_sample *s, uint64_t request_id,
                                 fr_msg *out)
{
    if (!out) return fr_fail(FR_EINVAL, "client: continuation needs out");
    fr_msg_init(out, FR_MSG_GENERATE);
    if (!g || !s || ((!g->prompt || g->n_prompt < 1) && !g->prompt_text))
        return fr_fail(FR_EINVAL, "client: continuation needs the request and its sample");
    const int before = g->continue_tokens ? g->n_continue_tokens : 0;
    if (s->start != before)
        return fr_fail(FR_EINVAL, "client: sample %d of request %llu starts at token %d, its request continued %d: "
                                  "give the request that made it",
                       s->sample, (unsigned long long)s->request_id, s->start, before);
    if (!s->has_seed)
        return fr_fail(FR_EINVAL, "client: sample %d of request %llu has no seed (the server did not report it): it "
                                  "cannot be continued as it would have gone on",
                       s->sample, (unsigned long long)s->request_id);
    fr_msg_generate *c = &out->u.generate;
    *c = *g;   /* the same sampling parameters; the arrays are copied below */
    c->request_id = request_id;
    c->n = 1;
    c->first_sample = s->sample;
    c->has_seed = 1;
    c->seed = s->seed;
    c->has_group_id = 1;   /* the continued sample stays in its group */
    c->group_id = g->has_group_id ? g->group_id : g->request_id;
    c->prompt_logprobs = 0;   /* they came with the sample's first part */
    c->forced_tokens = NULL;
    c->n_forced_tokens = 0;
    /* a text prompt goes again as text: the server's tokenizer makes the
     * same ids of it */
    c->prompt = g->prompt ? concat(g->prompt, g->n_prompt, NULL, 0) : NULL;
    c->stop_token_ids = g->has_stop_token_ids ? concat(g->stop_token_ids, g->n_stop_token_ids, NULL, 0) : NULL;
    c->continue_tokens = concat(g->continue_tokens, before, s->token_ids, s->n_tokens);
    c->n_continue_tokens = before + s->n_tokens;
    const int text_failed = fr_client_copy_generate_text(g, c);
    if ((g->prompt && !c->prompt) || !c->continue_tokens || (g->has_stop_token_ids && !c->stop_token_ids) ||
        text_failed) {
        fr_msg_free(out);
        fr_msg_init(out, FR_MSG_GENERATE);
        return fr_fail(FR_ENOMEM, "client: out of memory");
    }
    if (c->n_continue_tokens == 0) {   /* nothing was made: the sample from its start */
        free(c->continue_tokens);
        c->continue_tokens = NULL;
    }
    return FR_OK;
}
