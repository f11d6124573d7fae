#!/usr/bin/env bash
# `cmake --install` of the build tree into a staging root (DESTDIR) and
# into a prefix given at install time: the binaries run from there, every
# systemd unit points at an installed binary and flag file and passes
# `systemd-analyze verify`, nothing lands outside the prefix, and every flag
# in the example flag files is one the binary knows.
set -euo pipefail
BUILD_DIR=$1
ROOT=$(mktemp -d /tmp/kvtier-install-XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
fail() { echo "install_test: $*"; exit 1; }
DESTDIR=$ROOT cmake --install "$BUILD_DIR" >"$ROOT/install.log" 2>&1 ||
  { cat "$ROOT/install.log"; fail "cmake --install failed"; }
units=$(find "$ROOT" -path '*/lib/systemd/system/kvtier-*.service')
[[ $(wc -w <<<"$units") -eq 3 ]] || fail "expected 3 units, got: $units"
for unit in $units; do
  name=$(basename "$unit" .service)
  exec_line=$(grep '^ExecStart=' "$unit")
  bin=$(sed -E 's/^ExecStart=([^ ]+) .*/\1/' <<<"$exec_line")
  conf=$(sed -E 's/.*--flagfile=([^ ]+).*/\1/' <<<"$exec_line")
  [[ -x $ROOT$bin ]] || fail "$name: ExecStart binary $bin is not installed"
  [[ -f $ROOT$conf ]] || fail "$name: flag file $conf is not installed"
  "$ROOT$bin" --help >"$ROOT/help.txt" 2>&1 || true
  grep -q -- "--listen (" "$ROOT/help.txt" || fail "$name: the installed binary does not run"
  # Every flag the example sets (or shows commented out) exists.
  for flag in $(sed -nE 's/^#?--([a-z_]+)=.*/\1/p' "$ROOT$conf"); do
    grep -q -- "--$flag (" "$ROOT/help.txt" || fail "$name: $conf sets unknown --$flag"
  done
  # systemd-analyze resolves ExecStart on this machine: verify a copy that
  # points into the staging root.
  sed "s|$bin|$ROOT$bin|" "$unit" >"$ROOT/$name.service"
  systemd-analyze verify --man=no "$ROOT/$name.service" 2>"$ROOT/verify.txt" ||
    { cat "$ROOT/verify.txt"; fail "$name: systemd-analyze verify failed"; }
  if [[ -s $ROOT/verify.txt ]]; then cat "$ROOT/verify.txt"; fail "$name: verify warned"; fi
  grep -q '^User=kvtier' "$unit" || fail "$name: does not run as user kvtier"
  grep -q '^NoNewPrivileges=yes' "$unit" || fail "$name: no hardening"
done
# --prefix given at install time, not at configure time: every file lands
# under it (cmake's manifest lists them), the units name the binaries and
# flag files installed there, and the flag files name its configuration
# directory.
P=$ROOT/prefix
cmake --install "$BUILD_DIR" --prefix "$P" >"$ROOT/install-prefix.log" 2>&1 ||
  { cat "$ROOT/install-prefix.log"; fail "cmake --install --prefix failed"; }
manifest=$BUILD_DIR/install_manifest.txt
[[ -s $manifest ]] || fail "cmake --install wrote no $manifest"
outside=$(grep -v "^$P/" "$manifest" || true)
[[ -z $outside ]] || fail "installed outside --prefix $P: $outside"
units=$(find "$P/lib/systemd/system" -name 'kvtier-*.service' 2>/dev/null || true)
[[ $(wc -w <<<"$units") -eq 3 ]] || fail "--prefix: expected 3 units under $P, got: $units"
for unit in $units; do
  name=$(basename "$unit" .service)
  exec_line=$(grep '^ExecStart=' "$unit")
  bin=$(sed -E 's/^ExecStart=([^ ]+) .*/\1/' <<<"$exec_line")
  conf=$(sed -E 's/.*--flagfile=([^ ]+).*/\1/' <<<"$exec_line")
  [[ $bin == "$P/bin/$name" && -x $bin ]] || fail "--prefix: $name runs $bin"
  [[ $conf == "$P/etc/kvtier/$name.conf" && -f $conf ]] || fail "--prefix: $name reads $conf"
  if grep -nE '(^|[= ])/etc/kvtier' "$conf"; then fail "--prefix: $conf names /etc/kvtier"; fi
  systemd-analyze verify --man=no "$unit" 2>"$ROOT/verify.txt" ||
    { cat "$ROOT/verify.txt"; fail "--prefix: $name: systemd-analyze verify failed"; }
  if [[ -s $ROOT/verify.txt ]]; then cat "$ROOT/verify.txt"; fail "--prefix: $name: verify warned"; fi
done
[[ -f $P/etc/kvtier/tenants.example ]] || fail "--prefix: no tenants.example beside the flag files"
# The Python package, stubs included, imports from where it was installed.
pkg=$(find "$ROOT" -path '*/dist-packages/kvtier/__init__.py' | head -1)
[[ -n $pkg ]] || fail "the Python package is not installed"
[[ -f $(dirname "$pkg")/v1/worker_pb2_grpc.py ]] || fail "the Python stubs are not installed"
if /usr/bin/python3 -c "import grpc, numpy" 2>/dev/null; then
  PYTHONPATH=$(dirname "$(dirname "$pkg")") /usr/bin/python3 -c \
    "import kvtier; from kvtier.v1 import worker_pb2; print(kvtier.WorkerClient)" >/dev/null ||
    fail "the installed Python package does not import"
fi
# The C++ client SDK: a program outside the tree finds it with
# find_package(kvtier), builds, and talks to an installed kvtier-store.
config=$(find "$ROOT" -name kvtierConfig.cmake | head -1)
[[ -n $config ]] || fail "kvtierConfig.cmake is not installed"
prefix=$(cd "$(dirname "$config")/../../.." && pwd)
[[ -f $prefix/include/kvtier/client/store_client.h ]] || prefix=$(cd "$prefix/.." && pwd)
SRC_DIR=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$SRC_DIR/tests/sdk" -B "$ROOT/sdk-build" -DCMAKE_PREFIX_PATH="$prefix" \
  >"$ROOT/sdk.log" 2>&1 || { cat "$ROOT/sdk.log"; fail "find_package(kvtier) failed"; }
cmake --build "$ROOT/sdk-build" >>"$ROOT/sdk.log" 2>&1 ||
  { tail -30 "$ROOT/sdk.log"; fail "a program against the installed SDK does not build"; }
store_bin=$(find "$ROOT" -path '*/bin/kvtier-store' | head -1)
"$store_bin" --data_dir="$ROOT/db" --listen=127.0.0.1:0 --port_file="$ROOT/store.port" \
  --metrics_listen= 2>"$ROOT/store.log" &
store_pid=$!
trap 'kill $store_pid 2>/dev/null; wait $store_pid 2>/dev/null; rm -rf "$ROOT"' EXIT
for _ in $(seq 200); do [ -s "$ROOT/store.port" ] && break; sleep 0.05; done
"$ROOT/sdk-build/store_stats" "127.0.0.1:$(cat "$ROOT/store.port")" >"$ROOT/stats.txt" 2>&1 ||
  { cat "$ROOT/stats.txt"; fail "the SDK program cannot talk to the store"; }
grep -q "^sessions 0 tenant " "$ROOT/stats.txt" || { cat "$ROOT/stats.txt"; fail "unexpected answer"; }
echo "install_test: 3 units verified under DESTDIR and under --prefix (nothing outside it); binaries, flag files, the Python package and the C++ client SDK installed and used"
