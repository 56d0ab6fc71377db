.DEFAULT_GOAL := help
PY ?= .venv/bin/python

help: ## list the tasks
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

venv: ## create .venv and install ggnchunk with the test extra (as the README says)
	python3 -m venv .venv && .venv/bin/pip install -e '.[test]'

demo: ## the quick-start demo: BackPACK tutorial table, one pass vs chunks
	$(PY) -m experiments.tutorial_table

test: ## run the tests (the README's test command)
	$(PY) -m pytest

test-fast: ## run the tests without the slow ones
	$(PY) -m pytest -m "not slow"

lint: ## ruff format check, ruff lint, generated docs table in sync
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) tools/sync_readme.py --check

format: ## ruff format and autofix
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

tables: ## regenerate the supported-layers table on docs/supported.md from the code
	$(PY) tools/sync_readme.py

docs: ## build the documentation site (mkdocs, warnings are errors) into site/
	$(PY) -m mkdocs build --strict

bench: ## run the benchmark suite (quick)
	$(PY) -m benchmarks --quick

gpu-check: ## on a CUDA machine: every CUDA test and a GPU benchmark, one report (< 8 min)
	$(PY) -m tools.gpu_check

ci: ## what CI runs: fresh venv, install, tests, lint
	bash .ci/run

clean: ## remove caches and results
	rm -rf .pytest_cache .ruff_cache results build site *.egg-info
.PHONY: help venv demo test test-fast lint format tables docs bench gpu-check ci clean
