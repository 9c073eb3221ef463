/* weights_cuda: a Qwen3 (or DeepSeek-V3 latent attention) model's weights in GPU memory, BF16, in one device
 * allocation. Made from a host model (a checkpoint or synthetic:tiny, whose
 * float32 values are rounded to BF16: exact for BF16 checkpoints) or generated
 * on the GPU for the synthetic models too large for host memory, with the
 * same generator as rollout/model/synthetic_model.c, so synthetic:tiny made either
 * way holds the same bits.
 *
 * Layout choices made for the GPU forward pass:
 *   gate_up  [2 * intermediate][hidden]: gate_proj's rows, then up_proj's, so
 *            one matrix product yields [rows][gate | up] for the SwiGLU;
 *   lm_head  points at embed when the model ties them;
 *   experts  (Mixture-of-Experts layers) expert_gate_up [E][2 * Im][hidden]:
 *            each expert's gate rows, then its up rows, as gate_up;
 *            expert_down [E][hidden][Im]; the router [E][hidden] and, under
 *            noaux_tc routing, its bias [E] (BF16 like every weight: its
 *            rounding, 2^-9 of the bias, is below the BF16 router's own
 *            noise); DeepSeek's shared experts as one dense gate|up and down
 *            of Is = n_shared_experts * Im rows.
 * The synthetic MoE models' routers are drawn with a spread that differs from
 * expert to expert (fill kind ROUTER below), so that some experts win the
 * top-k far more often than others, as in trained routers.
 */
#ifndef FR_WEIGHTS_CUDA_H
#define FR_WEIGHTS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "base/fr_status.h"
#include "rollout/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    uint16_t *attn_norm, *q_norm, *k_norm, *mlp_norm;  /* [hidden] / [head_dim] */
    uint16_t *q_proj, *k_proj, *v_proj, *o_proj;       /* HF shapes, row-major */
    uint16_t *gate_up;                                 /* [2 * intermediate][hidden] */
    uint16_t *down_proj;                               /* [hidden][intermediate] */
    /* MoE layers only (gate_up and down_proj are then NULL) */
    uint16_t *router;                                  /* [E][hidden] */
    uint16_t *router_bias;                             /* [E] e_score_correction_bias (noaux_tc only), BF16 */
    uint16_t *expert_gate_up;                          /* [E][2 * Im][hidden] */
    uint16_t *expert_down;                             /* [E][hidden][Im] */
    uint16_t *shared_gate_up;                          /* [2 * Is][hidden]: DeepSeek's shared experts (or NULL) */
    uint16_t *shared_down;                             /* [hidden][Is] */
    /* Multi-head latent attention only (k_proj, v_proj, q_norm, k_norm are
     * then NULL; q_proj [H*(dn+dr)][hidden] only without a query low rank;
     * o_proj [hidden][H*dv]), shapes as in rollout/model/model.h: */
    uint16_t *q_a_proj, *q_a_norm;                     /* [q_lora][hidden], [q_lora] */
    uint16_t *q_b_proj;                                /* [H*(dn+dr)][q_lora] */
    uint16_t *kv_a_proj, *kv_a_norm;                   /* [dc+dr][hidden], [dc] */
    uint16_t *kv_b_proj;                               /* [H*(dn+dv)][dc] */
} fr_layer_weights_gpu;

typedef struct fr_weights_gpu {
    fr_model_config cfg;
    uint16_t *embed;        /* [vocab][hidden] */
    uint16_t *final_norm;   /* [hidden] */
    uint16_t *lm_head;      /* [vocab][hidden], == embed when tied */
    fr_layer_weights_gpu *layers; /* host array of device pointers */
    void *block_;           /* the one device allocation */
    size_t bytes;           /* its size */
    /* Tensor parallelism (rollout/model/tp_shard.h): cfg holds the local counts
     * (heads, KV heads, intermediate, vocabulary slice) of rank tp_rank of
     * tp_size; vocab_full is the model's vocabulary, the embedding's rows
     * (the embedding is whole on every rank). tp_size 1: the whole model. */
    int tp_rank, tp_size, vocab_full;
    void *host_copy_;       /* while released (fr_weights_gpu_release): block_'s bytes, on the host */
} fr_weights_gpu;

/* Copies a host model to the GPU as BF16. */
fr_status fr_weights_gpu_from_model(const fr_model *m, fr_weights_gpu **out);
/* Generates a synthetic model ("tiny" or "qwen3-4b", with its seed: see
 * fr_synthetic_parse) directly on the GPU. */
fr_status fr_weights_gpu_synthetic(const fr_model_config *cfg, uint64_t seed, fr_weights_gpu **out);
/* The device allocation and layout for cfg's tensors, unfilled (the
 * embedding gets vocab_full rows): for code that fills weights itself. */
fr_status fr_weights_gpu_alloc(const fr_model_config *cfg, int vocab_full, fr_weights_gpu **out);
/* Rank `rank` of `size`'s tensor-parallel shard of whole-model weights, as a
 * new device allocation (device-to-device copies: column-parallel tensors are
 * row ranges, o_proj and down_proj column ranges, the gate|up halves each
 * their slice; embedding and norms whole). full stays valid. */
fr_status fr_weights_gpu_shard(const fr_weights_gpu *full, int rank, int size, fr_weights_gpu **out);
void fr_weights_gpu_destroy(fr_weights_gpu **w);
/* Moves the weights to host memory and frees their device allocation (for
 * a trainer sharing the GPU), and back into a new allocation, every tensor
 * pointer rebased: whoever captured the old addresses (a decode graph)
 * must drop them. Idempotent; the weights must not be used while
 * released. */
fr_status fr_weights_gpu_release(fr_weights_gpu *w);
fr_status fr_weights_gpu_restore(fr_weights_gpu *w);

/* One tensor of device weights under its Hugging Face name (tensor_table.h
 * lists them): where its BF16 values start in w's block (gate_proj and
 * up_proj are the halves of gate_up) and its shape in w. In a
 * tensor-parallel shard a tensor is the whole model's (split NONE: norms,
 * embedding, router), a range of its rows (ROWS: q, k, v, gate, up, an
 * untied lm_head, the experts' gate and up; with latent attention q_b_proj
 * or q_proj and kv_b_proj, whose q_a_proj, kv_a_proj and their norms are
 * whole on every rank) or of its columns (COLS: o_proj,
 * down_proj, the experts' down; the shared experts' gate and up are ROWS and
 * their down COLS, the router bias NONE), starting at row or column `start` of the
 * whole tensor; shape is the local one. A tied lm_head is not listed (it is
 * the embedding). */
typedef enum { FR_SPLIT_NONE = 0, FR_SPLIT_ROWS, FR_SPLIT_COLS } fr_tensor_split;

typedef struct {
    char name[96];
    uint16_t *dst;
    int ndim;                /* 1 or 2 */
    int64_t shape[2];        /* shape[1] is 1 for 1-D tensors */
    fr_tensor_split split;
    int64_t start;
} fr_weights_gpu_tensor;

/* The tensors of w, in the order of rollout/model/tensor_table.h, as a new
 * array of *n (free()). full: the whole model's config, needed for a shard
 * (tp_size > 1; NULL for whole-model weights). */
fr_status fr_weights_gpu_tensors(const fr_weights_gpu *w, const fr_model_config *full, fr_weights_gpu_tensor **out,
                                 int *n);

/* Enqueues on stream (a cudaStream_t; NULL: the legacy stream) the copy of whole tensor src (of whole-model
 * weights) into dst, dst's part of it when dst belongs to a shard (its
 * split and start). FR_EINTERNAL with CUDA's text when the copy cannot be
 * enqueued. */
fr_status fr_weights_gpu_copy_tensor(const fr_weights_gpu_tensor *dst, const fr_weights_gpu_tensor *src,
                                     void *stream);

#ifdef __cplusplus
}
#endif

#endif
