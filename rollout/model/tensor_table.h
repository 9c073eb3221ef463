/* tensor_table: every named tensor of a model, under its Hugging Face name.
 *
 * The one list that maps checkpoint names to the float32 weights of
 * rollout/model/model.h: the checkpoint loader, weight updates and
 * push-weights all walk it, so a new kind of layer (the experts of a
 * Mixture-of-Experts model) is named in one place. */
#ifndef FR_TENSOR_TABLE_H
#define FR_TENSOR_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "base/fr_status.h"
#include "rollout/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Long enough for "model.layers.255.mlp.experts.4095.gate_proj.weight". */
#define FR_TENSOR_NAME_CAP 96

typedef struct {
    char name[FR_TENSOR_NAME_CAP];
    float *data;        /* where it lives in the weights walked (NULL if they hold none) */
    int ndim;           /* 1 or 2 */
    int64_t rows, cols; /* the Hugging Face shape; cols is 0 when ndim is 1 */
} fr_model_tensor;

/* Number of tensors fr_model_tensors_each visits for config c. */
size_t fr_model_tensor_count(const fr_model_config *c);

/* Called once per tensor; a non-OK status stops the walk and is returned. */
typedef fr_status (*fr_model_tensor_fn)(void *user, const fr_model_tensor *t);

/* Visits the tensors of weights w (laid out for config c, model.h) in block
 * order: embed, each layer's tensors (a MoE layer's router, its
 * e_score_correction_bias under noaux_tc routing, then expert 0's gate, up
 * and down, expert 1's, ..., then the shared experts' gate, up and down),
 * final norm, lm_head when untied. */
fr_status fr_model_tensors_each(const fr_model_config *c, const fr_weights *w, fr_model_tensor_fn fn, void *user);

/* The tensors fr_model_tensors_each visits, in its order, as a new array of
 * *n entries (the caller frees it). Callers holding a list in this order
 * (a weight update's) pair its entries by index, with no search by name. */
fr_status fr_model_tensor_list(const fr_model_config *c, const fr_weights *w, fr_model_tensor **out, size_t *n);

#ifdef __cplusplus
}
#endif

#endif
