#!/usr/bin/env bash
# ctest wrapper for vllm_check.py: vLLM's CPU build (the vLLM venv) serving
# Gemma 3 270M (its Hugging Face folder) with kvtier's connector and a
# kvtier-store from this build. KVTIER_VLLM_PYTHON and KVTIER_VLLM_MODEL come
# from scripts/kvtier.sh (exported by `scripts/kvtier.sh test`); without them
# (a bare ctest) the test is skipped (exit 77) with the commands that provide
# them. vLLM and torch leave caches and sockets in TMPDIR: the check runs
# with a TMPDIR of its own, removed afterwards unless the check failed.
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KVTIER_VLLM_PYTHON:-}" ] || [ -z "${KVTIER_VLLM_MODEL:-}" ]; then
  echo "skipped: run through 'make test', or set KVTIER_VLLM_PYTHON=\$(scripts/kvtier.sh vllm-venv)/bin/python" \
    "and KVTIER_VLLM_MODEL=\$(scripts/kvtier.sh vllm-model)"
  exit 77
fi
scratch=$(mktemp -d)
rc=0
TMPDIR=$scratch "$src/scripts/vllm_python.sh" "$src/tests/vllm_check.py" \
  --store_binary "$build/services/store/kvtier-store" --model "$KVTIER_VLLM_MODEL" || rc=$?
if [ "$rc" -eq 0 ]; then
  rm -rf "$scratch"
else
  echo "vllm_test: kept $scratch (the phases' logs are in its kvtier-vllm-* folder)"
fi
exit "$rc"
