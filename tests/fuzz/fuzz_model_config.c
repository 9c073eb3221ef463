/* libFuzzer target: the Hugging Face config.json parser
 * (rollout/model/model_config.h, fr_model_config_parse) on arbitrary text.
 *
 * The input is handed over as it is, without a NUL (the parser promises to
 * read only json[0, len)). A refused text must leave the config zeroed; an
 * accepted one must hold what the header promises: positive sizes, heads
 * divisible by KV heads, a positive finite RoPE theta, eps in (0, 1) and
 * token ids inside the vocabulary. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rollout/model/model_config.h"
#include "tests/fuzz/fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int all_zero(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return 0;
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fr_model_config c;
    memset(&c, 0xA5, sizeof c);
    fr_status st = fr_model_config_parse((const char *)data, size, "fuzz/config.json", &c);
    if (st != FR_OK) {
        FUZZ_CHECK(st == FR_EFORMAT || st == FR_EUNSUPPORTED || st == FR_ENOMEM, "status %d", (int)st);
        FUZZ_CHECK(all_zero(&c, sizeof c), "a refused config was not left zeroed");
        FUZZ_CHECK(fr_last_error()[0] != '\0', "a refused config left no message");
        return 0;
    }

    FUZZ_CHECK(strcmp(c.architecture, "Qwen3ForCausalLM") == 0 || strcmp(c.architecture, "Qwen3MoeForCausalLM") == 0 ||
                   strcmp(c.architecture, "DeepseekV2ForCausalLM") == 0 ||
                   strcmp(c.architecture, "DeepseekV3ForCausalLM") == 0,
               "architecture \"%.64s\"", c.architecture);
    FUZZ_CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.num_layers > 0 && c.num_heads > 0 &&
                   c.num_kv_heads > 0 && c.head_dim > 0 && c.intermediate_size > 0 && c.max_position > 0,
               "a size is not positive");
    FUZZ_CHECK(c.num_heads % c.num_kv_heads == 0, "%d heads over %d KV heads", c.num_heads, c.num_kv_heads);
    FUZZ_CHECK(c.rms_norm_eps >= 0 && c.rms_norm_eps <= 1, "rms_norm_eps %g", (double)c.rms_norm_eps);
    FUZZ_CHECK(isfinite(c.rope_theta) && c.rope_theta > 0, "rope_theta %g", c.rope_theta);
    const fr_rope_scaling *y = &c.rope_scaling;
    FUZZ_CHECK(!y->yarn || (y->factor >= 1 && y->factor <= 1e6 && y->original_max_position > 0 && y->beta_slow > 0 &&
                            y->beta_fast >= y->beta_slow && y->mscale >= 0 && y->mscale_all_dim >= 0 &&
                            y->attention_factor >= 0 && c.rope_theta > 1),
               "YaRN settings out of range (factor %g)", y->factor);
    FUZZ_CHECK(c.tie_word_embeddings == 0 || c.tie_word_embeddings == 1, "tie_word_embeddings %d",
               c.tie_word_embeddings);
    FUZZ_CHECK(c.bos_id >= -1 && c.bos_id < c.vocab_size, "bos_id %d", c.bos_id);
    FUZZ_CHECK(c.pad_id >= -1 && c.pad_id < c.vocab_size, "pad_id %d", c.pad_id);
    FUZZ_CHECK(c.n_eos >= 0 && c.n_eos <= 8, "n_eos %d", c.n_eos);
    for (int i = 0; i < c.n_eos; i++)
        FUZZ_CHECK(c.eos_ids[i] >= 0 && c.eos_ids[i] < c.vocab_size, "eos_ids[%d] = %d", i, c.eos_ids[i]);
    return 0;
}
