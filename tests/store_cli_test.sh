#!/usr/bin/env bash
# The store's command line as a new user meets it: --data_dir whose parents
# do not exist yet, `kvtier store get --out=DIR` (created with its parents;
# one that cannot be created is an error, not a silent exit 0), and a second
# store on a host whose metrics port is taken (an error naming
# --metrics_listen).
set -euo pipefail
BUILD_DIR=$1
STORE=$BUILD_DIR/services/store/kvtier-store
KV=$BUILD_DIR/tools/kvtier
W=$(mktemp -d /tmp/kvtier-store-cli-XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
fail() { echo "store_cli_test: $*"; exit 1; }
wait_file() { for _ in $(seq 100); do [[ -s $1 ]] && return 0; sleep 0.1; done; fail "no $1"; }

"$STORE" --data_dir="$W/not/yet/there/db" --listen=127.0.0.1:0 --port_file="$W/port" \
  --metrics_listen=127.0.0.1:0 --metrics_port_file="$W/mport" >"$W/store.log" 2>&1 &
PIDS+=($!)
wait_file "$W/port"
wait_file "$W/mport"
[[ -d $W/not/yet/there/db ]] || fail "--data_dir's parents were not created"
export KVTIER_STORE=127.0.0.1:$(cat "$W/port")

"$KV" store put --session=s --round=0 --layers=0:2 --tokens=8 >/dev/null
"$KV" store get --session=s --refs=0:0 --out="$W/out/a/b" >"$W/get.log"
[[ -s $W/out/a/b/s-r0-s0.segment ]] || { cat "$W/get.log"; fail "get --out wrote nothing"; }
touch "$W/file"
if "$KV" store get --session=s --refs=0:0 --out="$W/file/x" >"$W/get2.log" 2>&1; then
  cat "$W/get2.log"; fail "get --out under a file exited 0"
fi
grep -q -- "--out=" "$W/get2.log" || { cat "$W/get2.log"; fail "the error does not name --out"; }

# A second store on the first one's metrics port.
rc=0
timeout 20 "$STORE" --data_dir="$W/db2" --listen=127.0.0.1:0 \
  --metrics_listen=127.0.0.1:"$(cat "$W/mport")" >"$W/store2.log" 2>&1 || rc=$?
[[ $rc -ne 0 && $rc -ne 124 ]] || { cat "$W/store2.log"; fail "second store did not fail (rc $rc)"; }
grep -q -- "--metrics_listen" "$W/store2.log" || { cat "$W/store2.log"; fail "no hint at --metrics_listen"; }
echo "store_cli_test: ok"
