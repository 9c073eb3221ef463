# libFuzzer targets (tests/fuzz/README.md), included by the top Makefile.
# `make fuzz` builds BUILD/fuzz/fuzz_<target> with clang, libFuzzer, ASan and
# UBSan (any UB report aborts); scripts/run-fuzz.sh builds and runs them.
# `make fuzz-seeds` rewrites the generated seeds of the protocol and
# safetensors corpora. Neither is part of `make all`: clang is optional.
# Each target compiles the parser's sources itself, instrumented; only the
# serve configuration also links the module libraries, for the helpers of
# rollout/engine/session.c and base/ that the option table's rows use.

FUZZ_CC      ?= clang
FUZZ_DIR     := $(BUILD)/fuzz
FUZZ_TARGETS := protocol safetensors model_config serve_config tokenizer
FUZZ_BINS    := $(patsubst %,$(FUZZ_DIR)/fuzz_%,$(FUZZ_TARGETS))
FUZZ_CFLAGS  := -std=c11 -g -O1 -fno-omit-frame-pointer $(WARN) $(filter -D% -I%,$(CFLAGS)) \
                -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
FUZZ_HDRS    := $(wildcard tests/fuzz/*.h tests/unit/protocol_samples.h base/*.h app/*.h attention/*.h kvcache/*.h trainer_bridge/*.h trainer_bridge/*/*.h rollout/*/*.h tokenizer/*.h)
# the codec: every protocol file but the ZeroMQ framing (wire.c)
PROTO_SRCS   := $(filter-out %/wire.c,$(wildcard trainer_bridge/protocol/*.c)) $(BASE_SRCS)

.PHONY: fuzz fuzz-seeds
fuzz: $(FUZZ_BINS)

$(FUZZ_DIR)/fuzz_protocol: tests/fuzz/fuzz_protocol.c $(PROTO_SRCS) $(FUZZ_HDRS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(filter %.c,$^) -o $@ -lmsgpackc -lm

$(FUZZ_DIR)/fuzz_safetensors: tests/fuzz/fuzz_safetensors.c base/safetensors.c $(BASE_SRCS) $(FUZZ_HDRS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(filter %.c,$^) -o $@ -lcjson -lm

$(FUZZ_DIR)/fuzz_model_config: tests/fuzz/fuzz_model_config.c rollout/model/model_config.c $(BASE_SRCS) $(FUZZ_HDRS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(filter %.c,$^) -o $@ -lcjson -lm

$(FUZZ_DIR)/fuzz_serve_config: tests/fuzz/fuzz_serve_config.c app/serve_config.c app/serve_keys.c app/options.c \
                               attention/kv_numerics.c \
                               $(BASE_SRCS) $(FUZZ_HDRS) $(LIBS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(filter %.c,$^) $(LIBS) -o $@ $(LDLIBS)

$(FUZZ_DIR)/fuzz_tokenizer: tests/fuzz/fuzz_tokenizer.c $(wildcard tokenizer/*.c) $(BASE_SRCS) base/safetensors.c $(FUZZ_HDRS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(filter %.c,$^) -o $@ -lcjson -lpcre2-8 -lutf8proc -lm -pthread

$(FUZZ_DIR)/gen_seeds: tests/fuzz/gen_seeds.c $(PROTO_SRCS) $(FUZZ_HDRS)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -O1 $(WARN) -I. $(filter %.c,$^) -o $@ -lmsgpackc -lm

fuzz-seeds: $(FUZZ_DIR)/gen_seeds
	@mkdir -p tests/fuzz/corpus/protocol tests/fuzz/corpus/safetensors
	$(FUZZ_DIR)/gen_seeds tests/fuzz/corpus
