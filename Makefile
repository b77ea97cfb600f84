# Every target runs from a fresh clone: `make install` builds .venv, `make test` also
# builds the heavy test environments (real vLLM, real megatron-core) under
# $(FP32PATCH_TEST_CACHE), outside the repository, and reuses them afterwards.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
export FP32PATCH_TEST_CACHE ?= $(HOME)/.cache/fp32patch-tests
# heavy suites: tests/heavy/<env> runs under the interpreter of test environment <env>
HEAVY ?= $(notdir $(wildcard tests/heavy/*))

.PHONY: install test test-fast test-heavy demo bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,lint]'
	touch $@

test: test-fast test-heavy

test-fast: install
	$(VPY) -m pytest

test-heavy: install
	@set -e; for env in $(HEAVY); do \
	  $(VPY) tests/envs/build.py $$env; \
	  echo "== tests/heavy/$$env under $$($(VPY) tests/envs/build.py --path $$env)"; \
	  PYTHONPATH=$(CURDIR) $$($(VPY) tests/envs/build.py --path $$env) -m pytest -p no:cacheprovider tests/heavy/$$env; \
	done

demo: install
	$(VPY) -m fp32patch.demo

bench: install
	$(VPY) bench/lm_head.py

# bench/ may not exist yet; ruff refuses a missing path
LINT_PATHS := $(wildcard fp32patch tests bench)

lint: install
	$(VPY) -m ruff check $(LINT_PATHS)
	$(VPY) -m ruff format --check $(LINT_PATHS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
