#!/usr/bin/env bash
# ctest wrapper for llama_cpp_check.py: the evaluation venv's Python and the
# Gemma 3 270M file come from scripts/kvtier.sh (KVTIER_EVAL_PYTHON,
# KVTIER_GEMMA, exported by `scripts/kvtier.sh test`). Without them (a bare
# ctest) the test is skipped (exit 77) with the command that provides them.
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KVTIER_EVAL_PYTHON:-}" ] || [ -z "${KVTIER_GEMMA:-}" ]; then
  echo "skipped: run through 'make test', or set KVTIER_EVAL_PYTHON=\$(scripts/kvtier.sh venv)/bin/python" \
    "and KVTIER_GEMMA=\$(scripts/kvtier.sh model)"
  exit 77
fi
exec "$KVTIER_EVAL_PYTHON" "$src/tests/llama_cpp_check.py" --kvtier "$build/tools/kvtier" \
  --model "$KVTIER_GEMMA" --conversations "$src/traces/gemma3_chats.jsonl"
