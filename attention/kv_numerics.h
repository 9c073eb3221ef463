/* The numerics modes of the KV cache (docs/formats.md, design "KV cache
 * numerics"): the storage dtype, how the FP4 attention computes, and the
 * recipe switches used for ablations. Parsed from CLI strings here so every
 * command spells them the same way. */
#ifndef FR_KV_NUMERICS_H
#define FR_KV_NUMERICS_H

#include "microscale.h"
#include "prob_quant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* f32 is the CPU backend's exact storage: no rounding anywhere, so the decode
 * path can be checked against a float32 prefill to float32 precision. */
typedef enum { FR_KV_BF16 = 0, FR_KV_FP8, FR_KV_NVFP4, FR_KV_MXFP4, FR_KV_F32 } fr_kv_dtype;

/* exact: dual FP4 query and FP4 probabilities, as native FP4 MMAs compute;
 * bf16: query and probabilities unquantized; auto: the engine's choice for
 * its backend (bf16 on CUDA: on a GPU without FP4 tensor cores it is both
 * faster and closer to BF16 KV; exact on the CPU, the reference of the FP4
 * numerics). A cache is always built with exact or bf16. */
typedef enum { FR_COMPUTE_EXACT = 0, FR_COMPUTE_BF16, FR_COMPUTE_AUTO } fr_fp4_compute;

typedef struct {
    int smooth;       /* subtract the calibrated key mean */
    int rotate;       /* Hadamard rotation of keys and queries */
    int scale_search; /* NVFP4 {amax/6, amax/4}, MXFP4 {2^e, 2^(e+1)} */
    int dual_query;   /* dual-residual FP4 query (exact compute only) */
    int p_scaling;    /* underflow-aware P scaling (exact compute only) */
    int sink_recent;  /* BF16 sink (first 16 tokens) and recent partial page */
    int p_row_max;    /* analysis only, off in every preset and refused by the GPU
                         kernels: P blocks quantized against the row's final
                         maximum over all tokens (as an offline emulation does), not
                         the running maximum of online softmax (ref_attention.h) */
} fr_recipe;

#define FR_PAGE_TOKENS 128
#define FR_SINK_TOKENS 16

fr_recipe fr_recipe_full(void);
fr_recipe fr_recipe_vanilla(void);

fr_status fr_kv_dtype_parse(const char *s, fr_kv_dtype *out);
const char *fr_kv_dtype_name(fr_kv_dtype t);
int fr_kv_dtype_is_fp4(fr_kv_dtype t);
fr_fp4_format fr_kv_dtype_fp4_format(fr_kv_dtype t); /* NVFP4 for non-FP4 dtypes */
fr_status fr_fp4_compute_parse(const char *s, fr_fp4_compute *out);
const char *fr_fp4_compute_name(fr_fp4_compute c);

/* Parses a recipe: "full", "vanilla", or either followed by comma-separated
 * switches such as "full,-rotate,-sink" or "vanilla,+search". Switch names:
 * smooth, rotate, search, dual, pscale, sink. */
fr_status fr_recipe_parse(const char *s, fr_recipe *out);
/* Writes the canonical "full,-rotate" form into buf. */
void fr_recipe_format(const fr_recipe *r, char *buf, int len);

#ifdef __cplusplus
}
#endif

#endif
