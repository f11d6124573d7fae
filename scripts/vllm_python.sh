#!/usr/bin/env bash
# Runs a Python script in the vLLM venv with kvtier's package from this
# source tree and stubs that the venv's grpcio-tools generates for the venv's
# protobuf (newer than Debian's, which the build's stubs are for):
#   scripts/vllm_python.sh BUILD_DIR SCRIPT [ARGS...]
# The venv's Python is $KVTIER_VLLM_PYTHON, or scripts/kvtier.sh vllm-venv's.
set -euo pipefail
build=$(realpath "$1")
shift
src=$(cd "$(dirname "$0")/.." && pwd)
python=${KVTIER_VLLM_PYTHON:-$("$src/scripts/kvtier.sh" vllm-venv)/bin/python}
pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
mkdir -p "$pkg/kvtier/v1"
cp "$src"/python/kvtier/*.py "$pkg/kvtier/"
cp "$build/python/kvtier/_version.py" "$pkg/kvtier/"
touch "$pkg/kvtier/v1/__init__.py"
"$python" -m grpc_tools.protoc -I"$src/proto" --python_out="$pkg" --grpc_python_out="$pkg" \
  "$src"/proto/kvtier/v1/*.proto
PYTHONPATH="$pkg" "$python" "$@"
