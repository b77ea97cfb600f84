#!/usr/bin/env bash
# The main job on a real vLLM release: its two files that the patches edit and its .dist-info, read
# out of its PyPI wheel (HTTP range requests: about 1 MB, not the 400 MB wheel) and laid out as pip
# installs them in a throwaway import root, then list, status, apply, verify, diff and revert.
# `make demo` runs it with the CLI alone (no torch: the CLI never imports it) and keeps everything
# under build/demo (`make clean-demo` removes it).
set -euo pipefail
PY=${PY:-.venv/bin/python}
VLLM_VERSION=${VLLM_VERSION:-0.25.1}
ROOT=${DEMO_ROOT:-build/demo/vllm-$VLLM_VERSION}
NEMOTRON=vllm/model_executor/models/nemotron_h.py
LOGITS=vllm/model_executor/layers/logits_processor.py

if [ ! -f "$ROOT/$NEMOTRON" ]; then
  echo "fetching vLLM $VLLM_VERSION's $NEMOTRON, $LOGITS and .dist-info from PyPI into $ROOT"
  rm -rf "$ROOT"
  "$PY" -c 'import sys; from pathlib import Path; from tests.support.pypi import import_root_from_members as lay
lay("vllm", sys.argv[1], sys.argv[3:], Path(sys.argv[2]))' "$VLLM_VERSION" "$ROOT" "$NEMOTRON" "$LOGITS"
fi
"$PY" -m fp32patch revert -s "$ROOT" >/dev/null 2>&1 || true  # start from the stock files

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
printf '\nThe demo left %s (its environment and vLLM files); `make clean-demo` removes it.\n' "$(dirname "$ROOT")"
