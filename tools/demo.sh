#!/usr/bin/env bash
# The main job on a real vLLM: install a release from PyPI into a throwaway import root
# (as `pip install --target` would for an image), then apply, verify, diff and revert.
set -euo pipefail
PY=${PY:-.venv/bin/python}
VLLM_VERSION=${VLLM_VERSION:-0.25.1}
ROOT=${DEMO_ROOT:-${FP32PATCH_TEST_CACHE:-$HOME/.cache/fp32patch-tests}/demo/vllm-$VLLM_VERSION}

if [ ! -f "$ROOT/vllm/model_executor/models/nemotron_h.py" ]; then
  echo "installing vllm==$VLLM_VERSION (no dependencies) into $ROOT"
  rm -rf "$ROOT"
  "$PY" -m pip install -q --no-deps --no-compile --target "$ROOT" "vllm==$VLLM_VERSION"
fi
"$PY" -m fp32patch revert -s "$ROOT" >/dev/null 2>&1 || true  # start from the stock file

run() {
  printf '\n\033[1m$ fp32patch %s\033[0m\n' "$*"
  local code=0
  "$PY" -m fp32patch "$@" || code=$?
  printf '(exit %s)\n' "$code"
  return 0
}

run list
run status -s "$ROOT"
run apply -s "$ROOT"
run verify -s "$ROOT"
run apply -s "$ROOT"          # again: already-applied, nothing changes
run diff -s "$ROOT"
run verify -s "$ROOT" --json
run revert -s "$ROOT"
run verify -s "$ROOT"         # exit 1: the stock file is back, the patch is not applied
