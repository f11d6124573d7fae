#!/usr/bin/env bash
# The Python tests from the installed package: a fresh venv (with Debian's
# grpcio, protobuf, numpy, crc32c and pytest through --system-site-packages;
# nothing from the network), `pip install ./python` into it
# (scripts/python_package.sh), then pytest from outside the source tree.
#   tests/python_package_test.sh BUILD_DIR
set -euo pipefail
build=$(realpath "$1")
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
KVTIER_BUILD_DIR=$build "$src/scripts/python_package.sh" "$work/venv/bin/python" "$site"
cd "$work"
"$work/venv/bin/python" -c 'import kvtier; assert "/venv/" in kvtier.__file__, kvtier.__file__'
KVTIER_BUILD_DIR=$build KVTIER_SOURCE_DIR=$src "$work/venv/bin/python" -m pytest -q \
  -p no:cacheprovider --basetemp="$work/pytest" "$src/python/tests"
