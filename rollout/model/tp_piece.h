/* Which bytes of a weight tensor a tensor-parallel rank keeps, and where they
 * go: the rule a rank applies to each piece of a weight update that reaches
 * it whole (a broadcast bucket of docs/protocol.md, "Weights over NCCL"), so
 * it keeps only its shard and never holds the whole model.
 *
 * The parts are those of tp_shard.h (and of the device tensor table,
 * weights_cuda.h): a rank holds a tensor whole (norms, embedding, router and
 * its bias, the latent projections), a range of its rows (q, k, v, gate, up,
 * the experts' and shared experts' gate and up, q_b and kv_b, an untied
 * lm_head) or a range of its columns (o_proj, down_proj, the experts' and
 * shared experts' down). Its local copy is that part,
 * row-major and unpadded. Pure arithmetic: no MPI, no device. */
#ifndef FR_TP_PIECE_H
#define FR_TP_PIECE_H

#include <stdint.h>

#include "rollout/model/tp_shard.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FR_TP_WHOLE = 0, FR_TP_ROWS, FR_TP_COLS } fr_tp_split;

/* One tensor's part on one rank. rows x cols is the whole tensor (cols 1
 * for a 1-D tensor); the rank holds rows [start, start + len) (ROWS),
 * columns [start, start + len) (COLS), or everything (WHOLE: start 0,
 * len rows). */
typedef struct {
    fr_tp_split split;
    int64_t rows, cols;
    int64_t start, len;
} fr_tp_part;

/* The part of tensor `name` (a Hugging Face name, tensor_table.h) of whole
 * shape rows x cols (cols 0 or 1 for 1-D) that layout l's rank holds, for a
 * model of config cfg. FR_EINVAL naming the tensor when the part falls
 * outside the shape given. */
fr_status fr_tp_part_of(const fr_model_config *cfg, const fr_tp_layout *l, const char *name, int64_t rows,
                        int64_t cols, fr_tp_part *out);

/* Elements of the rank's local copy of the tensor. */
int64_t fr_tp_part_elems(const fr_tp_part *p);

/* A block of elements to copy: `rows` runs of `width` elements, the k-th
 * run from src + k * src_pitch (counted from the piece's first element) to
 * dst + k * dst_pitch (counted from the local copy's first element). */
typedef struct {
    uint64_t src, dst, width, rows, src_pitch, dst_pitch;
} fr_tp_rect;

#define FR_TP_PIECE_MAX_RECTS 3

/* The blocks of a piece, elements [first, first + n) of the whole tensor's
 * row-major data, that the rank keeps: none (0) when the piece lies outside
 * its part, one for a row range or a whole tensor, and up to three for a
 * column range (a partial first row, the full rows, a partial last row).
 * Returns how many were written to out; -1 (and nothing written) when the
 * piece does not lie inside the tensor. */
int fr_tp_piece_rects(const fr_tp_part *p, uint64_t first, uint64_t n, fr_tp_rect out[FR_TP_PIECE_MAX_RECTS]);

#ifdef __cplusplus
}
#endif

#endif
