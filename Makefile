# fp4rollout build. `make` builds build/fp4rollout, build/fp4rollout-client and
# the module libraries;
# `make test` installs missing packages, builds and runs every CPU test;
# `make demo` installs, builds and serves the bundled demo model to a Python
# trainer (examples/demo/run.sh).
# CUDA sources (named *_cuda.cu, and C files named *_cuda.c) build for sm_90a when nvcc
# is on the PATH; without it the CPU backend builds alone (FR_HAVE_CUDA unset)
# and C files named *_nocuda.c stand in for the CUDA ones, answering that the
# build has no CUDA (docs/architecture.md, "Conventions").
# Open MPI is required (scripts/install-deps.sh); NCCL is linked with CUDA.

BUILD    ?= build
CC       ?= cc
NVCC     ?= nvcc
HAVE_NVCC := $(shell command -v $(NVCC) >/dev/null 2>&1 && echo 1)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v $(NVCC) 2>/dev/null))

WARN     := -Wall -Wextra -Werror
CFLAGS   ?= -O2 -g
CFLAGS   += -std=c11 -ffp-contract=off -D_GNU_SOURCE -fPIC -pthread $(WARN) -I. -MMD -MP
# MPI's compile and link flags, as mpicc would pass them.
MPI_CFLAGS := $(shell pkg-config --cflags ompi-c 2>/dev/null || mpicc --showme:compile 2>/dev/null)
MPI_LIBS   := $(shell pkg-config --libs ompi-c 2>/dev/null || mpicc --showme:link 2>/dev/null)
CFLAGS   += $(MPI_CFLAGS)
LDLIBS   := -lopenblas -lcjson -lzmq -lmsgpackc -lxxhash -lmicrohttpd -lpcre2-8 -lutf8proc $(MPI_LIBS) -lm -pthread
NVFLAGS  := -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
            -Xcompiler -fPIC,-Wall,-Wextra -Werror all-warnings -I. -MMD -MP

# One static library per module, in dependency order (a module may use the
# ones after it in this list, never the ones before; docs/architecture.md).
MODULES  := app trainer_bridge/http trainer_bridge/server trainer_bridge/client rollout/monitor rollout/engine rollout/model \
            kvcache attention trainer_bridge/protocol comm tokenizer base
lib_of    = $(BUILD)/lib$(subst /,_,$(1)).a
# C files named *_cuda.c call the CUDA runtime: built only when nvcc is.
# Files named *_nocuda.c are their stand-ins: built only when nvcc is not.
# The programs' entry points link into the binaries themselves.
MAIN_SRC := app/main.c app/fp4rollout_client.c
srcs_of   = $(filter-out $(MAIN_SRC) $(if $(HAVE_NVCC),$(1)/%_nocuda.c,$(1)/%_cuda.c),$(wildcard $(1)/*.c))
cusrcs_of = $(if $(HAVE_NVCC),$(wildcard $(1)/*_cuda.cu))
objs_of   = $(patsubst %.c,$(BUILD)/obj/%.o,$(call srcs_of,$(1))) \
            $(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(call cusrcs_of,$(1)))
LIBS     := $(foreach m,$(MODULES),$(call lib_of,$(m)))
ifeq ($(HAVE_NVCC),1)
CFLAGS   += -DFR_HAVE_CUDA=1 -I$(CUDA_HOME)/include
LDLIBS   += -L$(CUDA_HOME)/lib64 -lnccl -lcublasLt -lcublas -lcudart -lstdc++
endif

BIN        := $(BUILD)/fp4rollout
MAIN_OBJ   := $(BUILD)/obj/app/main.o
# What of base/ the client library and the protocol's fuzz target compile in:
# all but the safetensors reader (which needs cJSON).
BASE_SRCS  := $(filter-out base/safetensors.c,$(wildcard base/*.c))
# The C client library of the trainer bridge: the protocol codec, the
# socket helpers and the client, with the error convention; it needs
# nothing but libzmq and msgpack-c. fp4rollout-client is its command line.
CLIENT_SRCS := $(wildcard trainer_bridge/protocol/*.c trainer_bridge/client/*.c) $(BASE_SRCS) comm/comm_status.c comm/dev_checksum.c \
               $(if $(HAVE_NVCC),comm/weight_group_cuda.c)
CLIENT_LIB := $(BUILD)/libfp4rollout_client.a
CLIENT_BIN := $(BUILD)/fp4rollout-client
CLIENT_LDLIBS := -lzmq -lmsgpackc -lxxhash -lm -pthread
# With CUDA the client also owns the trainer's side of an NCCL weight group
# (client_nccl.c over comm/weight_group_cuda.c) and the device checksum
# kernel; it still links nothing of rollout/.
CLIENT_CUOBJS := $(if $(HAVE_NVCC),$(BUILD)/obj/comm/dev_checksum_cuda.cu.o)
ifeq ($(HAVE_NVCC),1)
CLIENT_LDLIBS += -L$(CUDA_HOME)/lib64 -lnccl -lcudart
endif
# The same library shared, for language bindings (trainer_bridge/client/python/).
CLIENT_SO  := $(BUILD)/libfp4rollout_client.so
UNIT_HELP  := tests/unit/test_util.c tests/unit/tokenizer_util.c tests/unit/logits_util.c tests/unit/routes_util.c
UNIT_SRCS  := $(filter-out $(UNIT_HELP),$(wildcard tests/unit/test_*.c))
UNIT_BINS  := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRCS))
UNIT_HOBJ  := $(patsubst %.c,$(BUILD)/obj/%.o,$(UNIT_HELP))
# GPU tests (tests/gpu/test_*.c, cmocka) and their helpers (tests/gpu/*.cu, any
# other tests/gpu/*.c) build only with nvcc; they run on a machine with a GPU.
GPU_SRCS   := $(if $(HAVE_NVCC),$(wildcard tests/gpu/test_*.c))
GPU_BINS   := $(patsubst tests/gpu/%.c,$(BUILD)/gpu/%,$(GPU_SRCS))
GPU_HELP   := $(if $(HAVE_NVCC),$(filter-out $(GPU_SRCS),$(wildcard tests/gpu/*.c)) $(wildcard tests/gpu/*.cu))
GPU_HOBJ   := $(patsubst %.c,$(BUILD)/obj/%.o,$(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(GPU_HELP)))
# Benchmarks (bench/*.c, one program each) need a GPU too, but for the
# CPU ones of BENCH_CPU, which build everywhere (and with `make`, so that
# they keep compiling).
BENCH_CPU  := bench/tokenize_speed.c bench/stop_strings_speed.c
BENCH_SRCS := $(if $(HAVE_NVCC),$(wildcard bench/*.c),$(BENCH_CPU))
BENCH_BINS := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRCS))
BENCH_CPU_BINS := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_CPU))
# Benchmarks written in CUDA (bench/*_cuda.cu; today the check and timing of the
# kernel experiments of attention/dev/) build with the GPU tests, so that they
# keep compiling.
BENCH_CU_BINS := $(patsubst bench/%_cuda.cu,$(BUILD)/bench/%,$(if $(HAVE_NVCC),$(wildcard bench/*_cuda.cu)))

.PHONY: all deps test unit integration demo gpu bench clean
.SECONDARY: $(UNIT_HOBJ) $(GPU_HOBJ)
all: $(BIN) $(CLIENT_BIN) $(CLIENT_SO) $(UNIT_BINS) $(GPU_BINS) $(BENCH_BINS) $(BENCH_CU_BINS)
gpu: $(GPU_BINS) bench
bench: $(BENCH_BINS) $(BENCH_CU_BINS)

deps:
	@scripts/install-deps.sh

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/obj/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

define module_rule
$(call lib_of,$(1)): $(call objs_of,$(1))
	@mkdir -p $$(dir $$@)
	rm -f $$@ && ar rcs $$@ $$^
endef
$(foreach m,$(MODULES),$(eval $(call module_rule,$(m))))

# The dashboard's page and charting library are embedded with .incbin,
# which the compiler's dependency files do not see.
$(BUILD)/obj/rollout/monitor/dashboard_assets.o: rollout/monitor/dashboard.html $(wildcard rollout/monitor/vendor/uplot/*)

$(BIN): $(MAIN_OBJ) $(LIBS)
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

$(CLIENT_LIB): $(patsubst %.c,$(BUILD)/obj/%.o,$(CLIENT_SRCS)) $(CLIENT_CUOBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(CLIENT_SO): $(patsubst %.c,$(BUILD)/obj/%.o,$(CLIENT_SRCS)) $(CLIENT_CUOBJS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -shared $^ -o $@ $(CLIENT_LDLIBS)

# push-weights reads a model with rollout/: the tool links the engine's
# libraries after the client library (the library itself stays light), and
# of app/ its own commands (app/client_*.c), the option table with its
# parser (one way of parsing for both programs) and the text helpers of
# the JSON lines (app/cli_text.c).
CLIENT_APP_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,app/options.c app/cli_parse.c app/cli_help.c app/cli_common.c \
                     app/cli_text.c $(wildcard app/client_*.c))
$(CLIENT_BIN): $(BUILD)/obj/app/fp4rollout_client.o $(CLIENT_APP_OBJS) $(CLIENT_LIB) $(filter-out $(call lib_of,app) $(BUILD)/libtrainer_bridge_%,$(LIBS))
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/tests/%: tests/unit/%.c $(UNIT_HOBJ) $(LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< $(UNIT_HOBJ) $(LIBS) -o $@ -lcmocka $(LDLIBS)

$(BUILD)/gpu/%: tests/gpu/%.c $(UNIT_HOBJ) $(GPU_HOBJ) $(LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< $(UNIT_HOBJ) $(GPU_HOBJ) $(LIBS) -o $@ -lcmocka $(LDLIBS)

$(BUILD)/bench/%: bench/%.c $(LIBS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< $(LIBS) -o $@ $(LDLIBS)

BENCH_CU_LIBS := $(call lib_of,kvcache) $(call lib_of,attention) $(call lib_of,base)
$(BUILD)/bench/%: bench/%_cuda.cu $(BENCH_CU_LIBS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) $< $(BENCH_CU_LIBS) -o $@

# The tokenizer's benchmark needs only its module and base/.
$(BUILD)/bench/tokenize_speed: bench/tokenize_speed.c $(call lib_of,tokenizer) $(call lib_of,base)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $^ -o $@ -lcjson -lpcre2-8 -lutf8proc -lm -pthread

# The two entry points build on every core (JOBS, default nproc): the CUDA
# kernels alone take minutes one at a time.
JOBS ?= $(shell nproc 2>/dev/null || echo 1)

test: deps
	@$(MAKE) --no-print-directory -j$(JOBS) all
	@scripts/run-tests.sh $(BUILD)

demo: deps
	@$(MAKE) --no-print-directory -j$(JOBS) $(BIN) $(CLIENT_SO)
	@examples/demo/run.sh $(BUILD)

clean:
	rm -rf $(BUILD)

# libFuzzer targets: `make fuzz` (clang), run by scripts/run-fuzz.sh.
include tests/fuzz/fuzz.mk

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
