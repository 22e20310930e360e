# One-command setup, demo and tests. Torch is pinned and installed first: a bare `torch`
# requirement may pull a multi-GB CUDA build. transformers 5.2.x keeps kvpress (<5.3)
# installable beside it as a baseline; override with `make TRANSFORMERS=5.24.0 test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= 2.13.0
TRANSFORMERS ?= 5.2.0

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q -e ".[test,peers]" "transformers==$(TRANSFORMERS)"
	$(PY) -m kv_cache.kernels || echo "warning: compiled kernels not built; kv_cache falls back to torch"
	touch $@

demo: setup
	$(PY) -m kv_cache.cli demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/bench_quantizer.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
