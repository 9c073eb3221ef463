#include "rollout/model/tp_piece.h"

#include <string.h>

static int ends_with(const char *s, const char *tail)
{
    const size_t a = strlen(s), b = strlen(tail);
    return a >= b && strcmp(s + a - b, tail) == 0;
}

/* The split of a tensor by its name's ending, as tp_shard.c cuts it. */
static void part_by_name(const fr_model_config *c, const fr_tp_layout *l, const char *name, fr_tp_part *p)
{
    const int64_t D = c->head_dim, h0 = l->head0, nh = l->n_heads;
    const int mla = fr_model_is_mla(c);
    const int64_t qh = mla ? (int64_t)c->qk_nope_dim + c->qk_rope_dim : D;
    const int64_t ov = mla ? (int64_t)c->v_head_dim : D;
    const int64_t kvb = (int64_t)c->qk_nope_dim + c->v_head_dim;
    const int expert = strstr(name, ".mlp.experts.") != NULL, shared = strstr(name, ".mlp.shared_experts.") != NULL;
#define SET(s, a, n) (p->split = (s), p->start = (a), p->len = (n))
    if (ends_with(name, ".self_attn.q_proj.weight") || ends_with(name, ".self_attn.q_b_proj.weight"))
        SET(FR_TP_ROWS, h0 * qh, nh * qh);
    else if (ends_with(name, ".self_attn.kv_b_proj.weight"))
        SET(FR_TP_ROWS, h0 * kvb, nh * kvb);
    else if (!mla && (ends_with(name, ".self_attn.k_proj.weight") || ends_with(name, ".self_attn.v_proj.weight")))
        SET(FR_TP_ROWS, (int64_t)l->kv_head0 * D, (int64_t)l->n_kv_heads * D);
    else if (ends_with(name, ".self_attn.o_proj.weight"))
        SET(FR_TP_COLS, h0 * ov, nh * ov);
    else if (expert && (ends_with(name, ".gate_proj.weight") || ends_with(name, ".up_proj.weight")))
        SET(FR_TP_ROWS, l->moe_inter0, l->moe_inter);
    else if (expert && ends_with(name, ".down_proj.weight"))
        SET(FR_TP_COLS, l->moe_inter0, l->moe_inter);
    else if (shared && (ends_with(name, ".gate_proj.weight") || ends_with(name, ".up_proj.weight")))
        SET(FR_TP_ROWS, l->shared_inter0, l->shared_inter);
    else if (shared && ends_with(name, ".down_proj.weight"))
        SET(FR_TP_COLS, l->shared_inter0, l->shared_inter);
    else if (ends_with(name, ".mlp.gate_proj.weight") || ends_with(name, ".mlp.up_proj.weight"))
        SET(FR_TP_ROWS, l->inter0, l->inter);
    else if (ends_with(name, ".mlp.down_proj.weight"))
        SET(FR_TP_COLS, l->inter0, l->inter);
    else if (strcmp(name, "lm_head.weight") == 0)
        SET(FR_TP_ROWS, l->vocab0, l->vocab);
    else
        SET(FR_TP_WHOLE, 0, p->rows);
#undef SET
}

fr_status fr_tp_part_of(const fr_model_config *cfg, const fr_tp_layout *l, const char *name, int64_t rows,
                        int64_t cols, fr_tp_part *out)
{
    if (!cfg || !l || !name || !out) return fr_fail(FR_EINVAL, "fr_tp_part_of: NULL argument");
    memset(out, 0, sizeof *out);
    if (rows < 1 || cols < 0) return fr_fail(FR_EINVAL, "tensor parallel: \"%s\" has no elements", name);
    out->rows = rows;
    out->cols = cols > 0 ? cols : 1;
    part_by_name(cfg, l, name, out);
    const int64_t dim = out->split == FR_TP_COLS ? out->cols : out->rows;
    if (out->start < 0 || out->len < 1 || out->start + out->len > dim)
        return fr_fail(FR_EINVAL, "tensor parallel: rank %d's part of \"%s\" (%s %lld..%lld) is outside its shape "
                       "%lld x %lld", l->rank, name, out->split == FR_TP_COLS ? "columns" : "rows",
                       (long long)out->start, (long long)(out->start + out->len), (long long)out->rows,
                       (long long)out->cols);
    return FR_OK;
}

int64_t fr_tp_part_elems(const fr_tp_part *p)
{
    return p->split == FR_TP_COLS ? p->rows * p->len : p->len * p->cols;
}

/* Row r's kept elements [r * cols + start, + len) met with [first, end):
 * one run, or nothing. */
static int row_run(const fr_tp_part *p, uint64_t r, uint64_t first, uint64_t end, fr_tp_rect *out)
{
    const uint64_t cols = (uint64_t)p->cols, s = (uint64_t)p->start, len = (uint64_t)p->len;
    uint64_t a = r * cols + s, b = a + len;
    if (a < first) a = first;
    if (b > end) b = end;
    if (a >= b) return 0;
    *out = (fr_tp_rect){.src = a - first, .dst = r * len + (a - r * cols - s), .width = b - a, .rows = 1,
                        .src_pitch = cols, .dst_pitch = len};
    return 1;
}

int fr_tp_piece_rects(const fr_tp_part *p, uint64_t first, uint64_t n, fr_tp_rect out[FR_TP_PIECE_MAX_RECTS])
{
    const uint64_t total = (uint64_t)p->rows * (uint64_t)p->cols;
    if (n < 1 || first > total || n > total - first) return -1;
    const uint64_t end = first + n;
    if (p->split != FR_TP_COLS) {
        /* the part is one contiguous range of the row-major data */
        uint64_t a = (uint64_t)p->start * (uint64_t)p->cols, b = a + (uint64_t)p->len * (uint64_t)p->cols;
        const uint64_t base = a;
        if (a < first) a = first;
        if (b > end) b = end;
        if (a >= b) return 0;
        out[0] = (fr_tp_rect){.src = a - first, .dst = a - base, .width = b - a, .rows = 1, .src_pitch = b - a,
                              .dst_pitch = b - a};
        return 1;
    }
    const uint64_t cols = (uint64_t)p->cols, r0 = first / cols, r1 = (end - 1) / cols;
    int k = row_run(p, r0, first, end, &out[0]);
    if (r1 == r0) return k;
    if (r1 > r0 + 1) {
        /* rows r0 + 1 .. r1 - 1 lie wholly inside the piece: one block */
        const uint64_t s = (uint64_t)p->start, len = (uint64_t)p->len;
        out[k++] = (fr_tp_rect){.src = (r0 + 1) * cols + s - first, .dst = (r0 + 1) * len, .width = len,
                                .rows = r1 - r0 - 1, .src_pitch = cols, .dst_pitch = len};
    }
    k += row_run(p, r1, first, end, &out[k]);
    return k;
}
