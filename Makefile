# Quick start: `make demo` and `make test` each install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/.dagster
export EAGLE3_ROOT ?= $(CURDIR)/.eagle3
# Two cores here: keep torch from oversubscribing them when several processes run.
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export DAGSTER_DISABLE_TELEMETRY ?= 1

.PHONY: install ui-deps demo run test test-fast test-peer-import ui bench bench-demo bench-arch clean

$(BIN)/.installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) PYTHON=$(PYTHON) bash scripts/install.sh
	touch $@

install: $(BIN)/.installed $(DAGSTER_HOME)/dagster.yaml

# The instance config lives in the repo; DAGSTER_HOME gets a copy (refreshed when the repo's is newer).
$(DAGSTER_HOME)/dagster.yaml: dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp dagster.yaml $@

# Chromium and PostgreSQL (Debian packages) for the UI and PostgreSQL tests.
ui-deps:
	bash scripts/install_ui_deps.sh

# `make demo TARGET=deepseek_v3` runs the same graph on a miniature of another architecture (Kimi-K2's shape;
# eagle3_assets/architectures/ lists them), in a store and Dagster home of its own.
TARGET ?= llama
DEMO_ENV := $(if $(filter-out llama,$(TARGET)),EAGLE3_DEMO_ARCHITECTURE=$(TARGET) EAGLE3_ROOT=$(CURDIR)/.eagle3-$(TARGET) DAGSTER_HOME=$(CURDIR)/.dagster-$(TARGET))
demo: install
	$(if $(DEMO_ENV),mkdir -p $(CURDIR)/.dagster-$(TARGET) && cp dagster.yaml $(CURDIR)/.dagster-$(TARGET)/dagster.yaml)
	$(DEMO_ENV) $(BIN)/python -m eagle3_assets.start

# The whole graph on CONFIG (the demo without it), one run per shard; run it again to resume.
# `make run ARGS=--list-shards` lists the shard keys and where each stands; `make run ARGS=--plan` says what the
# next run would do, why, and at what cost, running nothing; `make run ARGS=--approve` approves the plan the daemon
# waits on (approval.limit_s), running nothing.
run: install
	$(if $(CONFIG),EAGLE3_CONFIG=$(abspath $(CONFIG))) $(BIN)/python -m eagle3_assets.start $(ARGS)

# The whole suite, as CI runs it, on both cores: one pytest worker per core, each module on one
# worker (its module fixtures are built once). Every failure is reported (no -x); it ends with the
# slowest tests and the suite's time against its 25-minute budget, so a creeping suite shows in
# the CI log before it hits the budget.
TEST_WORKERS ?= 2
test: install ui-deps
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 eagle3_assets_tests

# For iterating: no model training, no servers, no vLLM (the tests not marked slow): under 3 minutes.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" eagle3_assets_tests

# A drafter written by the real speculators package (PyPI 0.9.0) imports as the release and drafts exactly what
# speculators' own forward drafts (test_drafter_import.py), then goes through the whole graph: served alone,
# continued, served beside its continuation and replaced by it (test_import_end_to_end.py). speculators pins its own
# torch stack, so it runs from a venv of its own, built here on first use (.peer/speculators/); `make test` runs the
# same import on a checkpoint written in its layout by the test itself, and skips these when that venv is absent.
test-peer-import: install
	bash benchmarks/peer/setup_speculators_venv.sh
	$(BIN)/python -m pytest -q eagle3_assets_tests/test_drafter_import.py eagle3_assets_tests/test_import_end_to_end.py \
		-k "speculators_drafts or (gated and speculators)"

ui: install
	$(BIN)/python -m eagle3_assets.ui

bench: install
	$(BIN)/python benchmarks/bench_vocab_map.py

# The full-size demo (exactly what `make demo` builds, killed once and resumed) held to the
# quality bars of BENCHMARKS.md, with the off-by-one and topic-drift drafters; `make test` runs
# the same module on a small demo. 26 minutes on 2 quiet cores (2026-12-07).
bench-demo: install
	EAGLE3_DEMO_SIZE=full $(BIN)/python -m pytest -q --durations=10 eagle3_assets_tests/test_demo_quality.py

# The architecture matrix at bench size (1,200 rows a leg) on every architecture the CPU build serves, held to the
# same assertions as in `make test`, then its figures (BENCHMARKS.md `architectures`).
BENCH_ARCHITECTURES ?= deepseek_v3,kimi_k25,qwen3_moe,gpt_oss,qwen3,llama
bench-arch: install
	rm -rf benchmarks/out/arch
	EAGLE3_ARCHITECTURES=$(BENCH_ARCHITECTURES) EAGLE3_ARCH_ROWS=1200 $(BIN)/python -m pytest -q --basetemp=benchmarks/out/arch eagle3_assets_tests/test_architectures.py
	$(BIN)/python benchmarks/bench_arch.py benchmarks/out/arch/arch-*[0-9]

clean:
	rm -rf $(VENV) .dagster .eagle3 .dagster-* .eagle3-*
