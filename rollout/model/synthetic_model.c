/* synthetic:tiny, a random Qwen3 that needs no files, synthetic:tiny-qwen3,
 * the same dimensions with Qwen3's vocabulary (151,936 ids, Qwen3's special
 * ids): text through Qwen3's tokenizer on a model small enough for CI, and
 * the real dense shapes (synthetic:qwen3-4b, qwen3-14b) where the host has
 * the memory for them as float32.
 *
 * The weights are a pure function of the seed, bit-identical on every machine,
 * because the generator uses only integer arithmetic plus IEEE-754 double
 * multiplications and one sqrt (all correctly rounded), never libm's
 * transcendental functions (whose last bits differ between libraries), and no
 * fused multiply-adds (the build compiles with -ffp-contract=off):
 *
 *   mix64(z)       the splitmix64 finalizer:
 *                    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
 *                    z = (z ^ (z >> 27)) * 0x94d049bb133111eb
 *                    z ^ (z >> 31)
 *   stream t       tensor t (its index in the block order of model.h: embed
 *                  is 0, layer l's k-th tensor is 1 + 11 l + k, then
 *                  final_norm, then lm_head) draws from its own splitmix64
 *                  sequence: state = mix64(seed ^ mix64(t + 1)); each draw
 *                  adds 0x9e3779b97f4a7c15 to the state and returns mix64(state).
 *   normal draw    Irwin-Hall: six 64-bit draws give twelve 32-bit uniforms
 *                  U_j (high and low halves); z = (sum U_j - 6 * 2^32) * 2^-32
 *                  (exact in double): mean 0, variance 1, range (-6, 6).
 *   values         element e of a tensor (row-major) takes the e-th normal z:
 *                    embed                 (float) z
 *                    projections           (float)(z * (1 / sqrt(fan_in)))
 *                                          fan_in = the row length (in_features)
 *                    norm weights          (float)(1 + 0.1 * z)
 *
 * With unit-variance embeddings and 1/sqrt(fan_in) projections every matmul
 * roughly preserves the variance of its input, so activations and logits stay
 * O(1) through the two layers.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/host_memory.h"
#include "rollout/model/model.h"
#include "rollout/model/tensor_table.h"

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct {
    uint64_t s;
} syn_rng;

static uint64_t syn_next(syn_rng *r) { return mix64(r->s += 0x9e3779b97f4a7c15ull); }

static double syn_normal(syn_rng *r)
{
    uint64_t sum = 0;
    for (int j = 0; j < 6; j++) {
        uint64_t v = syn_next(r);
        sum += (v >> 32) + (v & 0xffffffffull);
    }
    int64_t centered = (int64_t)sum - (int64_t)(6ull << 32);
    return (double)centered * 0x1p-32;
}

/* The tiny DeepSeek models add two kinds: ROUTER, a projection whose rows
 * (experts) have spreads 0.25 .. 3 times a projection's in a scattered order,
 * so some experts win the top-k far more often than others (as the device
 * generator's routers, weights_cuda.cu); BIAS, 0.05 z (a router bias that
 * moves some choices without dwarfing the sigmoid scores). */
typedef enum { FILL_EMBED, FILL_PROJ, FILL_NORM, FILL_ROUTER, FILL_BIAS } fill_kind;

static void fill(float *dst, size_t rows, size_t cols, fill_kind kind, uint64_t seed, uint64_t tensor)
{
    syn_rng r = {mix64(seed ^ mix64(tensor + 1))};
    double scale = kind == FILL_PROJ || kind == FILL_ROUTER ? 1.0 / sqrt((double)cols) : 1.0;
    size_t n = rows * cols;
    for (size_t e = 0; e < n; e++) {
        double z = syn_normal(&r);
        switch (kind) {
        case FILL_EMBED: dst[e] = (float)z; break;
        case FILL_PROJ: dst[e] = (float)(z * scale); break;
        case FILL_NORM: dst[e] = (float)(1.0 + 0.1 * z); break;
        case FILL_ROUTER: {
            const double u = (double)((e / cols * 37) % rows) / (double)rows;
            dst[e] = (float)(z * scale * (0.25 + 2.75 * (u * u)));
            break;
        }
        case FILL_BIAS: dst[e] = (float)(0.05 * z); break;
        }
    }
}

void fr_synthetic_tiny_config(fr_model_config *cfg)
{
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->architecture, sizeof cfg->architecture, "Qwen3ForCausalLM");
    cfg->vocab_size = 272;
    cfg->hidden_size = 128;
    cfg->num_layers = 2;
    cfg->num_heads = 4;
    cfg->num_kv_heads = 2;
    cfg->head_dim = 64;
    cfg->intermediate_size = 256;
    cfg->max_position = 4096;
    cfg->rms_norm_eps = 1e-6f;
    cfg->rope_theta = 10000.0;
    cfg->tie_word_embeddings = 0;
    cfg->bos_id = 256;
    cfg->pad_id = 258;
    cfg->n_eos = 1;
    cfg->eos_ids[0] = 257;
}

/* The Qwen tokenizer's vocabulary and special ids. */
static void qwen_vocab(fr_model_config *cfg)
{
    cfg->vocab_size = 151936;
    cfg->bos_id = 151643;
    cfg->pad_id = 151643;
    cfg->n_eos = 1;
    cfg->eos_ids[0] = 151645;
}

void fr_synthetic_tiny_qwen3_config(fr_model_config *cfg)
{
    if (!cfg) return;
    fr_synthetic_tiny_config(cfg);
    /* Untied, as tiny: a tied random table makes the model repeat its
     * input token, and text tests want varied tokens (every script, bytes
     * split across tokens). */
    qwen_vocab(cfg);
}

/* The weights of a two-layer configuration c (tiny's shapes, any
 * vocabulary), named base[:seed], on the host. */
static fr_status synthetic_small(const fr_model_config *cfg, const char *base, uint64_t seed, fr_model **out)
{
    *out = NULL;
    fr_model_config c = *cfg;
    char name[64];
    if (seed == FR_SYNTHETIC_DEFAULT_SEED)
        snprintf(name, sizeof name, "%s%s", FR_SYNTHETIC_PREFIX, base);
    else
        snprintf(name, sizeof name, "%s%s:%" PRIu64, FR_SYNTHETIC_PREFIX, base, seed);
    fr_model *m = NULL;
    fr_status rc = fr_model_alloc(&c, name, &m);
    if (rc != FR_OK) return rc;
    /* The block is only reserved so far: refuse before filling pages the
     * kernel may not have (Qwen3-4B's shape takes 16 GB as float32). */
    const size_t need = fr_model_param_count(m) * sizeof(float), avail = fr_host_mem_available();
    if (avail && need > avail / 10 * 9) {
        fr_model_destroy(&m);
        return fr_fail(FR_ENOMEM, "%s: its weights take %.1f GB of host memory as float32 and %.1f GB are available; "
                       "--backend cuda generates them on the GPU in BF16", name, (double)need / 1e9, (double)avail / 1e9);
    }

    size_t V = (size_t)c.vocab_size, H = (size_t)c.hidden_size, D = (size_t)c.head_dim,
           I = (size_t)c.intermediate_size;
    size_t qd = (size_t)c.num_heads * D, kvd = (size_t)c.num_kv_heads * D;
    uint64_t t = 0;
    fill(m->w.embed, V, H, FILL_EMBED, seed, t++);
    for (int l = 0; l < c.num_layers; l++) {
        fr_layer_weights *L = &m->w.layers[l];
        fill(L->attn_norm, 1, H, FILL_NORM, seed, t++);
        fill(L->q_proj, qd, H, FILL_PROJ, seed, t++);
        fill(L->k_proj, kvd, H, FILL_PROJ, seed, t++);
        fill(L->v_proj, kvd, H, FILL_PROJ, seed, t++);
        fill(L->o_proj, H, qd, FILL_PROJ, seed, t++);
        fill(L->q_norm, 1, D, FILL_NORM, seed, t++);
        fill(L->k_norm, 1, D, FILL_NORM, seed, t++);
        fill(L->mlp_norm, 1, H, FILL_NORM, seed, t++);
        fill(L->gate_proj, I, H, FILL_PROJ, seed, t++);
        fill(L->up_proj, I, H, FILL_PROJ, seed, t++);
        fill(L->down_proj, H, I, FILL_PROJ, seed, t++);
    }
    fill(m->w.final_norm, 1, H, FILL_NORM, seed, t++);
    if (!c.tie_word_embeddings) fill(m->w.lm_head, V, H, FILL_PROJ, seed, t++);
    *out = m;
    return FR_OK;
}

fr_status fr_model_synthetic_tiny(uint64_t seed, fr_model **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_model_synthetic_tiny: out is NULL");
    fr_model_config c;
    fr_synthetic_tiny_config(&c);
    return synthetic_small(&c, "tiny", seed, out);
}

void fr_synthetic_qwen3_4b_config(fr_model_config *cfg)
{
    if (!cfg) return;
    fr_synthetic_tiny_config(cfg);   /* every size below replaces tiny's */
    cfg->hidden_size = 2560;
    cfg->num_layers = 36;
    cfg->num_heads = 32;
    cfg->num_kv_heads = 8;
    cfg->head_dim = 128;
    cfg->intermediate_size = 9728;
    cfg->max_position = 40960;
    cfg->rope_theta = 1000000.0;
    cfg->tie_word_embeddings = 1;
    qwen_vocab(cfg);
}

void fr_synthetic_qwen3_30b_a3b_config(fr_model_config *cfg)
{
    if (!cfg) return;
    fr_synthetic_qwen3_4b_config(cfg);   /* tokenizer ids, head_dim, RoPE */
    snprintf(cfg->architecture, sizeof cfg->architecture, "Qwen3MoeForCausalLM");
    cfg->hidden_size = 2048;
    cfg->num_layers = 48;
    cfg->num_heads = 32;
    cfg->num_kv_heads = 4;
    cfg->intermediate_size = 6144;   /* unused: every layer is sparse */
    cfg->tie_word_embeddings = 0;
    cfg->num_experts = 128;
    cfg->experts_per_tok = 8;
    cfg->moe_intermediate_size = 768;
    cfg->norm_topk_prob = 1;
    cfg->decoder_sparse_step = 1;
    memset(cfg->mlp_only, 0, sizeof cfg->mlp_only);
}

void fr_synthetic_qwen3_14b_config(fr_model_config *cfg)
{
    if (!cfg) return;
    fr_synthetic_qwen3_4b_config(cfg);   /* tokenizer ids, head_dim, RoPE */
    cfg->hidden_size = 5120;
    cfg->num_layers = 40;
    cfg->num_heads = 40;   /* 5 query heads per KV head: a group that is no power of two */
    cfg->num_kv_heads = 8;
    cfg->intermediate_size = 17408;
    cfg->tie_word_embeddings = 0;
}

void fr_synthetic_tiny_dsmoe_config(fr_model_config *cfg, int v2)
{
    if (!cfg) return;
    fr_synthetic_tiny_config(cfg);   /* the byte tokenizer's ids, RMSNorm, RoPE, window */
    snprintf(cfg->architecture, sizeof cfg->architecture, "%s", v2 ? "DeepseekV2ForCausalLM" : "DeepseekV3ForCausalLM");
    cfg->num_layers = 3;
    cfg->num_heads = 4;
    cfg->num_kv_heads = 1;
    /* latent 256 and RoPE 64 (tqa's; the GPU's latent kernel takes latents of 128 to 512) */
    cfg->kv_lora_rank = 256;
    cfg->qk_rope_dim = 64;
    cfg->qk_nope_dim = 64;
    cfg->v_head_dim = 64;
    cfg->q_lora_rank = v2 ? 64 : 0;
    cfg->rope_interleave = 1;
    cfg->head_dim = cfg->kv_lora_rank + cfg->qk_rope_dim;
    cfg->intermediate_size = 256;
    cfg->num_experts = 16;
    cfg->experts_per_tok = 4;
    cfg->moe_intermediate_size = 64;
    cfg->decoder_sparse_step = 1;
    memset(cfg->mlp_only, 0, sizeof cfg->mlp_only);
    cfg->mlp_only[0] = 1;   /* first_k_dense_replace 1 */
    cfg->n_group = 4;
    cfg->topk_group = 2;
    cfg->scoring_func = v2 ? FR_MOE_SOFTMAX : FR_MOE_SIGMOID;
    cfg->topk_method = v2 ? FR_MOE_GROUP_LIMITED : FR_MOE_NOAUX_TC;
    cfg->norm_topk_prob = !v2;
    cfg->routed_scaling_factor = v2 ? 1.5f : 2.5f;
    cfg->n_shared_experts = v2 ? 2 : 1;
}

void fr_synthetic_deepseek_v2_lite_config(fr_model_config *cfg)
{
    if (!cfg) return;
    fr_synthetic_tiny_dsmoe_config(cfg, 1);
    cfg->vocab_size = 102400;
    cfg->hidden_size = 2048;
    cfg->num_layers = 27;
    cfg->num_heads = 16;
    cfg->kv_lora_rank = 512;
    cfg->qk_rope_dim = 64;
    cfg->qk_nope_dim = 128;
    cfg->v_head_dim = 128;
    cfg->q_lora_rank = 0;
    cfg->head_dim = cfg->kv_lora_rank + cfg->qk_rope_dim;
    cfg->intermediate_size = 10944;
    cfg->num_experts = 64;
    cfg->experts_per_tok = 6;
    cfg->moe_intermediate_size = 1408;
    cfg->n_shared_experts = 2;
    cfg->n_group = cfg->topk_group = 1;
    cfg->scoring_func = FR_MOE_SOFTMAX;
    cfg->topk_method = FR_MOE_GREEDY;
    cfg->norm_topk_prob = 0;
    cfg->routed_scaling_factor = 1.0f;
    /* The published window (163,840) comes with YaRN scaling; this shape
     * keeps plain RoPE and a 32K window, which sizes the device workspaces
     * for benchmarks (a loaded checkpoint gets its config's YaRN). */
    cfg->max_position = 32768;
    cfg->bos_id = 100000;
    cfg->pad_id = 100001;
    cfg->eos_ids[0] = 100001;
}

/* Whether rest's name part (before any ":SEED") is exactly `name`. */
static int named(const char *rest, size_t len, const char *name)
{
    return len == strlen(name) && strncmp(rest, name, len) == 0;
}

/* tiny-dsmoe-dcN: synthetic:tiny-dsmoe with latent width N, which exercises
 * the latent kernels' widths (the GPU builds 128 to 512 in steps of 64; a
 * width it lacks runs on the CPU under --backend auto). N is a multiple of
 * 64 from 64 to 512 (the CPU cache's widest row is 576, RoPE included).
 * Returns N, 0 when the name is not of this form, -1 when N is out of range. */
#define DSMOE_DC_PREFIX "tiny-dsmoe-dc"

static int dsmoe_latent_width(const char *rest, size_t len)
{
    const size_t pre = strlen(DSMOE_DC_PREFIX);
    if (len <= pre || len > pre + 3 || strncmp(rest, DSMOE_DC_PREFIX, pre) != 0) return 0;
    int n = 0;
    for (size_t i = pre; i < len; i++) {
        if (rest[i] < '0' || rest[i] > '9') return 0;
        n = 10 * n + (rest[i] - '0');
    }
    return n >= 64 && n <= 512 && n % 64 == 0 ? n : -1;
}

fr_status fr_synthetic_parse(const char *rest, fr_model_config *cfg, uint64_t *seed_out)
{
    if (!rest || !cfg || !seed_out) return fr_fail(FR_EINVAL, "fr_synthetic_parse: NULL argument");
    const char *colon = strchr(rest, ':');
    size_t name_len = colon ? (size_t)(colon - rest) : strlen(rest);
    int dc = 0;
    /* The -128k variants: the same weights with a 131,072-token window
     * (Qwen3's extended context), for decode benchmarks at 64K and beyond. */
    if (named(rest, name_len, "tiny"))
        fr_synthetic_tiny_config(cfg);
    else if (named(rest, name_len, "tiny-qwen3"))
        fr_synthetic_tiny_qwen3_config(cfg);
    else if (named(rest, name_len, "qwen3-4b") || named(rest, name_len, "qwen3-4b-128k"))
        fr_synthetic_qwen3_4b_config(cfg);
    else if (named(rest, name_len, "qwen3-14b") || named(rest, name_len, "qwen3-14b-128k"))
        fr_synthetic_qwen3_14b_config(cfg);
    else if (named(rest, name_len, "qwen3-30b-a3b") || named(rest, name_len, "qwen3-30b-a3b-128k"))
        fr_synthetic_qwen3_30b_a3b_config(cfg);
    else if (named(rest, name_len, "tiny-dsmoe") || named(rest, name_len, "tiny-dsmoe-v2"))
        fr_synthetic_tiny_dsmoe_config(cfg, named(rest, name_len, "tiny-dsmoe-v2"));
    else if (named(rest, name_len, "deepseek-v2-lite"))
        fr_synthetic_deepseek_v2_lite_config(cfg);
    else if ((dc = dsmoe_latent_width(rest, name_len)) > 0) {
        fr_synthetic_tiny_dsmoe_config(cfg, 0);
        cfg->kv_lora_rank = dc;
        cfg->head_dim = dc + cfg->qk_rope_dim;
    } else if (dc < 0)
        return fr_fail(FR_EINVAL, "spec \"%s%.*s\": the latent width of " DSMOE_DC_PREFIX "N is a multiple of 64 "
                       "from 64 to 512", FR_SYNTHETIC_PREFIX, (int)name_len, rest);
    else
        return fr_fail(FR_EINVAL, "unknown synthetic model \"%.*s\" in spec \"%s%s\" (known: %stiny[:SEED], "
                       "%stiny-qwen3[:SEED], %sqwen3-4b[-128k][:SEED], %sqwen3-14b[-128k][:SEED], "
                       "%sqwen3-30b-a3b[-128k][:SEED], %stiny-dsmoe[-v2][:SEED], %s" DSMOE_DC_PREFIX "N[:SEED], "
                       "%sdeepseek-v2-lite[:SEED])",
                       (int)(name_len > 64 ? 64 : name_len), rest, FR_SYNTHETIC_PREFIX, rest, FR_SYNTHETIC_PREFIX,
                       FR_SYNTHETIC_PREFIX, FR_SYNTHETIC_PREFIX, FR_SYNTHETIC_PREFIX, FR_SYNTHETIC_PREFIX,
                       FR_SYNTHETIC_PREFIX, FR_SYNTHETIC_PREFIX, FR_SYNTHETIC_PREFIX);
    if (name_len > 5 && strncmp(rest + name_len - 5, "-128k", 5) == 0) cfg->max_position = 131072;
    uint64_t seed = FR_SYNTHETIC_DEFAULT_SEED;
    if (colon) {
        const char *s = colon + 1;
        int digits = s[0] != '\0';
        for (const char *p = s; *p; p++) digits = digits && *p >= '0' && *p <= '9';
        errno = 0;
        unsigned long long v = digits ? strtoull(s, NULL, 10) : 0;
        if (!digits || errno == ERANGE)
            return fr_fail(FR_EINVAL, "spec \"%s%s\": seed \"%s\" is not a decimal integer in [0, 2^64)",
                           FR_SYNTHETIC_PREFIX, rest, s);
        seed = (uint64_t)v;
    }
    *seed_out = seed;
    return FR_OK;
}

/* The fill of one tensor of a tiny DeepSeek model, by its name and shape. */
typedef struct {
    uint64_t seed, t;
} dsmoe_fill;

static int ends_with(const char *s, const char *tail)
{
    const size_t a = strlen(s), b = strlen(tail);
    return a >= b && strcmp(s + a - b, tail) == 0;
}

static fr_status fill_named(void *user, const fr_model_tensor *t)
{
    dsmoe_fill *f = user;
    fill_kind kind = FILL_PROJ;
    if (strcmp(t->name, "model.embed_tokens.weight") == 0) kind = FILL_EMBED;
    else if (ends_with(t->name, ".e_score_correction_bias")) kind = FILL_BIAS;
    else if (ends_with(t->name, ".mlp.gate.weight")) kind = FILL_ROUTER;
    else if (t->ndim == 1) kind = FILL_NORM;
    fill(t->data, (size_t)t->rows, t->ndim == 2 ? (size_t)t->cols : 1, kind, f->seed, f->t++);
    return FR_OK;
}

fr_status fr_model_synthetic_dsmoe(const fr_model_config *cfg, const char *name, uint64_t seed, fr_model **out)
{
    if (!out || !cfg) return fr_fail(FR_EINVAL, "fr_model_synthetic_dsmoe: NULL argument");
    *out = NULL;
    fr_model *m = NULL;
    fr_status st = fr_model_alloc(cfg, name, &m);
    dsmoe_fill f = {.seed = seed, .t = 0};
    if (!st) st = fr_model_tensors_each(&m->cfg, &m->w, fill_named, &f);
    if (st) fr_model_destroy(&m);
    *out = m;
    return st;
}

int fr_synthetic_host_only(const char *rest)
{
    fr_model_config cfg;
    uint64_t seed;
    if (!rest || fr_synthetic_parse(rest, &cfg, &seed)) return 0;
    return cfg.vocab_size == 272 && fr_model_is_mla(&cfg);   /* the tiny DeepSeek models */
}

fr_status fr_model_synthetic(const char *rest, fr_model **out)
{
    if (!out) return fr_fail(FR_EINVAL, "fr_model_synthetic: out is NULL");
    *out = NULL;
    fr_model_config cfg;
    uint64_t seed;
    fr_status st = fr_synthetic_parse(rest, &cfg, &seed);
    if (st) return st;
    const int qwen3 = strcmp(cfg.architecture, "Qwen3ForCausalLM") == 0;
    /* The host generates the dense Qwen3 shapes (synthetic_small checks
     * that they fit in memory as float32) and the 272-id DeepSeek ones; the
     * mixture-of-experts shapes only the GPU does. */
    if (cfg.vocab_size != 272 && !qwen3)
        return fr_fail(FR_EUNSUPPORTED, "%s%s: the weights of this synthetic model are generated on the GPU; "
                       "it needs --backend cuda", FR_SYNTHETIC_PREFIX, rest);
    const char *colon = strchr(rest, ':');
    char base[32];
    snprintf(base, sizeof base, "%.*s", (int)(colon ? colon - rest : (ptrdiff_t)strlen(rest)), rest);
    if (qwen3) return synthetic_small(&cfg, base, seed, out);
    char name[96];
    snprintf(name, sizeof name, "%s%s", FR_SYNTHETIC_PREFIX, rest);
    return fr_model_synthetic_dsmoe(&cfg, name, seed, out);
}
