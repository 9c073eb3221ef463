/* tokenizer: Hugging Face tokenizer.json files, encoded and decoded in C.
 *
 * The ids a checkpoint's tokenizer.json gives are the contract between a
 * trainer and the engine, so this library reproduces Hugging Face
 * `tokenizers` byte for byte rather than approximately: byte-level BPE
 * (Qwen2/Qwen3, Llama 3, DeepSeek-V3, GPT-2) and SentencePiece-style BPE with
 * byte fallback (Llama 2, Mistral). A file using a component this library
 * does not implement (WordPiece, Unigram, an unknown normalizer, ...) is
 * refused at load with a message naming it, never encoded differently.
 * tokenizer/README.md lists what is supported and how it matches.
 *
 * A loaded tokenizer is immutable: any number of threads may encode and
 * decode with it at once. Strings are UTF-8 with explicit lengths (NUL is an
 * ordinary character); ids are the checkpoint's token ids.
 */
#ifndef FR_TOKENIZER_H
#define FR_TOKENIZER_H

#include <stddef.h>

#include "base/fr_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_tokenizer fr_tokenizer;

/* Load flags. */
enum {
    /* Ignore tokenizer_config.json: encode exactly as `tokenizers` does with
     * the tokenizer.json alone (no beginning-of-sequence token that only
     * transformers' class would add; no bos/eos names). */
    FR_TOK_NO_CONFIG = 1u << 0,
};

/* Loads `path`: a tokenizer.json, or a folder holding one. A
 * tokenizer_config.json beside it, when present, names the bos and eos
 * tokens and, for the classes transformers builds a template for (Llama,
 * CodeLlama, Gemma), says whether encoding with special tokens adds them
 * (add_bos_token, add_eos_token), as transformers' tokenizer does.
 * fr_tokenizer_load is fr_tokenizer_load_opts with flags 0. */
fr_status fr_tokenizer_load(const char *path, fr_tokenizer **out);
fr_status fr_tokenizer_load_opts(const char *path, unsigned flags, fr_tokenizer **out);

/* The same from memory: the text of a tokenizer.json and, optionally (NULL),
 * of its tokenizer_config.json. `label` names the source in messages. */
fr_status fr_tokenizer_from_json(const char *json, size_t len, const char *config, size_t config_len,
                                 const char *label, fr_tokenizer **out);

/* The tokenizer of byte-level models (the bundled demo model, the project's
 * test models), which ship no tokenizer.json: ids 0-255 are the bytes, and
 * every id from 256 to vocab_size - 1 is a special token written "<ID>"
 * ("<256>"). Encoding with special tokens puts bos_id first; bos_id and
 * eos_id (-1: none) are what fr_tokenizer_bos_id and _eos_id give. Made as
 * the tokenizer.json such a model would ship (a byte-level BPE without
 * merges), so everything above works on it as on any other. */
fr_status fr_tokenizer_bytes(int vocab_size, int bos_id, int eos_id, fr_tokenizer **out);

/* Frees *tok and sets it to NULL; accepts NULL and a pointer to NULL. */
void fr_tokenizer_free(fr_tokenizer **tok);

/* Encodes len bytes of UTF-8 text into a malloc'd array of *n ids (the
 * caller frees it; NULL when *n is 0). add_special: apply the post-processor
 * (a beginning-of-sequence token, say), as `add_special_tokens=True` does.
 * Special tokens written in the text (`<|im_start|>`) are always recognised,
 * as Hugging Face does. Text that is not valid UTF-8 is refused (FR_EINVAL,
 * naming the byte offset), and so is text over 1 GiB. */
fr_status fr_tokenizer_encode(const fr_tokenizer *tok, const char *text, size_t len, int add_special, int **ids,
                              size_t *n);

/* Decodes n ids into malloc'd UTF-8 text of *len bytes, NUL-terminated (the
 * caller frees it). skip_special drops special tokens. Ids the vocabulary
 * does not hold are skipped, and bytes that do not form UTF-8 become U+FFFD,
 * as Hugging Face does. */
fr_status fr_tokenizer_decode(const fr_tokenizer *tok, const int *ids, size_t n, int skip_special, char **text,
                              size_t *len);

/* One more than the largest id the tokenizer knows (model vocabulary and
 * added tokens): every id it produces is below it. A checkpoint's embedding
 * may have more rows. */
int fr_tokenizer_vocab_size(const fr_tokenizer *tok);

/* The id of a token written as in the vocabulary or the added tokens
 * ("<|im_end|>", "Ġthe"), or -1. */
int fr_tokenizer_token_id(const fr_tokenizer *tok, const char *token);

/* The vocabulary's string of id (not NUL-terminated, *len bytes), or NULL. */
const char *fr_tokenizer_id_token(const fr_tokenizer *tok, int id, size_t *len);

/* Whether id is a special token (skipped by skip_special). */
int fr_tokenizer_is_special(const fr_tokenizer *tok, int id);

/* The bos and eos ids that tokenizer_config.json names, or -1. */
int fr_tokenizer_bos_id(const fr_tokenizer *tok);
int fr_tokenizer_eos_id(const fr_tokenizer *tok);

/* Incremental detokenizer, for streamed text and stop strings: feed the ids
 * of a sequence one at a time, get the text they complete. A piece of text
 * is handed out only once it can no longer change: never half a UTF-8
 * character, never a byte-fallback sequence still waiting for its next
 * bytes. The pieces joined equal fr_tokenizer_decode of all the ids once
 * fr_detok_finish has handed out what was held back, for every tokenizer
 * of which fr_tokenizer_streams_exactly says so (Qwen3's, DeepSeek's, the
 * SentencePiece-style ones); others stream as tokenizers' DecodeStream
 * does. It keeps a window of a few ids, not the whole sequence. */
typedef struct fr_detok fr_detok;

/* 1 when streamed pieces always add up to the decode: no decoder edits the
 * text at its start or end once the tokens are joined into one string
 * (Strip of more than one leading or of any trailing character, Replace or
 * Metaspace after Fuse or ByteLevel, or BPEDecoder's last-token rule). Such
 * an edit at the edge of the window lands where it would not in the whole
 * text, so those tokenizers' pieces can differ from the decode, as
 * DecodeStream's do. */
int fr_tokenizer_streams_exactly(const fr_tokenizer *tok);

fr_status fr_detok_new(const fr_tokenizer *tok, int skip_special, fr_detok **out);
/* Adds one id. *text (not NUL-terminated, *len bytes, possibly 0) is the new
 * complete text, valid until the next call on d. */
fr_status fr_detok_push(fr_detok *d, int id, const char **text, size_t *len);
/* Hands out what is held back (an incomplete character decodes to U+FFFD)
 * and starts a new sequence. */
fr_status fr_detok_finish(fr_detok *d, const char **text, size_t *len);
void fr_detok_free(fr_detok **d);

#ifdef __cplusplus
}
#endif

#endif
