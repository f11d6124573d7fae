#!/usr/bin/env bash
# `TLS=1 make demo-cluster`, small: a real kvtier-controller, three stores and
# two workers, every connection mutual TLS with certificates the script makes
# (openssl), a client without a certificate refused, a store and a worker
# killed partway, the repair, and fidelity unchanged by the failures.
set -euo pipefail
BUILD_DIR=$1
SRC_DIR=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-cluster-tls-test-XXXXXX")
trap 'rm -rf "$OUT"' EXIT
TLS=1 SESSIONS=2 ROUNDS=10 KILL_STORE_AT=3 KILL_WORKER_AT=6 \
  "$SRC_DIR/scripts/cluster_demo.sh" "$BUILD_DIR" >"$OUT/stdout" 2>&1 || {
  cat "$OUT/stdout"
  exit 1
}
for want in "^a client without a certificate is refused: .*UNAVAILABLE" \
  "^live nodes: 5 of 5" "kill -9 store-1" "kill -9 worker-1" \
  "^identical: the failures cost time, not fidelity"; do
  grep -q "$want" "$OUT/stdout" || { echo "missing: $want"; cat "$OUT/stdout"; exit 1; }
done
