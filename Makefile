# One-command setup, demo and tests. Torch is pinned and installed first: a bare `torch`
# requirement may pull a multi-GB CUDA build. The suite runs under two transformers releases,
# the lowest supported one (5.2.0, in .venv; it keeps kvpress (<5.3) installable beside it as a
# baseline) and the newest one tested (5.24.0, in .venv-latest): `make test` runs both,
# `make test-min` / `make test-latest` one of them. `make demo` uses .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= 2.13.0
TRANSFORMERS ?= 5.2.0
EXTRAS ?= test,peers,serve,lm-eval
LATEST_VENV ?= .venv-latest
LATEST_TRANSFORMERS ?= 5.24.0

.PHONY: setup setup-latest demo test test-min test-latest bench clean

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

demo: setup
	$(PY) -m kv_cache.cli demo

# Both releases, one after the other; the second runs even if the first fails, and the
# target fails if either did.
test: setup setup-latest
	@status=0; \
	echo "== tests under transformers $(TRANSFORMERS) ($(VENV)) =="; \
	$(PY) -m pytest -q || status=1; \
	echo "== tests under transformers $(LATEST_TRANSFORMERS) ($(LATEST_VENV)) =="; \
	$(LATEST_VENV)/bin/python -m pytest -q || status=1; \
	exit $$status

test-min: setup
	$(PY) -m pytest -q

test-latest: setup-latest
	$(LATEST_VENV)/bin/python -m pytest -q

bench: setup
	$(PY) benchmarks/bench_quantizer.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) build *.egg-info src/*.egg-info
