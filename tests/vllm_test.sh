#!/usr/bin/env bash
# ctest wrapper for vllm_check.py: vLLM's CPU build (the vLLM venv) serving
# Gemma 3 270M (its Hugging Face folder) with kvtier's connector and a
# kvtier-store from this build. KVTIER_VLLM_PYTHON and KVTIER_VLLM_MODEL come
# from scripts/kvtier.sh (exported by `scripts/kvtier.sh test`); without them
# (a bare ctest) the test is skipped (exit 77) with the commands that provide
# them.
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KVTIER_VLLM_PYTHON:-}" ] || [ -z "${KVTIER_VLLM_MODEL:-}" ]; then
  echo "skipped: run through 'make test', or set KVTIER_VLLM_PYTHON=\$(scripts/kvtier.sh vllm-venv)/bin/python" \
    "and KVTIER_VLLM_MODEL=\$(scripts/kvtier.sh vllm-model)"
  exit 77
fi
exec "$src/scripts/vllm_python.sh" "$src/tests/vllm_check.py" \
  --store_binary "$build/services/store/kvtier-store" --model "$KVTIER_VLLM_MODEL"
