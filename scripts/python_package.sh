#!/usr/bin/env bash
# Installs kvtier's Python package for PYTHON into DEST (`pip install
# --target`, offline: --no-build-isolation needs setuptools in PYTHON's
# environment), built from a copy of python/, proto/ and CMakeLists.txt so
# that the build leaves nothing in the source tree. The stubs come from
# PYTHON's grpcio-tools when it has them, else from protoc (python/setup.py);
# with KVTIER_BUILD_DIR set, the package takes that build's in-process worker.
#   scripts/python_package.sh PYTHON DEST
set -euo pipefail
python=$1 dest=$2
src=$(cd "$(dirname "$0")/.." && pwd)
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
cp -r "$src/python" "$src/proto" "$src/CMakeLists.txt" "$copy/"
rm -rf "$copy/python/build" "$copy/python"/*.egg-info
"$python" -m pip install -q --no-build-isolation --no-deps --no-index --target "$dest" \
  "$copy/python"
