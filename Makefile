# make test  - set up .venv (CPU PyTorch pinned) and run the test suite
# make demo  - set up and run speculative decoding on a code prompt
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0

.PHONY: setup test demo bench clean

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

bench: setup
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
