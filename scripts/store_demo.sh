#!/usr/bin/env bash
# `make demo-store`: kvtier-store on its own (`make demo` is the full chat
# demo, scripts/demo.sh). This starts a real kvtier-store on loopback (RocksDB in a temp dir) and
# drives it the way a worker will: each conversation round is stored as two
# segments split at the watershed layer, a recall fetches the upper segments
# of chosen rounds in ONE GetSegments call, and a kill -9 loses nothing that
# was acknowledged.
set -euo pipefail
BUILD_DIR=${1:-build}
KV="$BUILD_DIR/tools/kvtier"
STORE_BIN="$BUILD_DIR/services/store/kvtier-store"
WORK=$(mktemp -d /tmp/kvtier-demo-XXXXXX)
STORE_PID=
cleanup() {
  [ -n "$STORE_PID" ] && kill "$STORE_PID" 2>/dev/null && wait "$STORE_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

# Demo model: 8 layers, 8 KV heads, head_dim 128, fp16; watershed layer 2,
# so segment 0 holds layers [0,3) and segment 1 layers [3,8).
LAYERS=8 KV_HEADS=8 HEAD_DIM=128 SPLIT=3 TOKENS=128 SESSIONS=3 ROUNDS=6
RAM_MB=${RAM_MB:-12}

start_store() {
  rm -f "$WORK/port"
  "$STORE_BIN" --data_dir="$WORK/db" --listen=127.0.0.1:0 --port_file="$WORK/port" \
    --metrics_listen=127.0.0.1:0 --metrics_port_file="$WORK/mport" \
    --ram_budget_mb="$RAM_MB" 2>>"$WORK/store.log" &
  STORE_PID=$!
  for _ in $(seq 300); do [ -s "$WORK/port" ] && break; sleep 0.05; done
  [ -s "$WORK/port" ] || { echo "kvtier-store did not start:"; tail "$WORK/store.log"; exit 1; }
  export KVTIER_STORE=127.0.0.1:$(cat "$WORK/port")
}

step() { printf '\n== %s\n' "$*"; }

step "Starting kvtier-store (RocksDB in $WORK/db, RAM tier budget ${RAM_MB} MiB)"
start_store
echo "serving on $KVTIER_STORE, metrics on 127.0.0.1:$(cat "$WORK/mport")/metrics"

step "Writing $SESSIONS conversations x $ROUNDS rounds; each round = 2 segments split at the watershed layer"
for s in $(seq 0 $((SESSIONS - 1))); do
  for r in $(seq 0 $((ROUNDS - 1))); do
    "$KV" store put --session=chat-$s --round=$r --segment=0 --layers=0:$SPLIT \
      --tokens=$TOKENS --kv_heads=$KV_HEADS --head_dim=$HEAD_DIM --seed=$((s * 100 + r)) \
      --question_tokens=24
    "$KV" store put --session=chat-$s --round=$r --segment=1 --layers=$SPLIT:$LAYERS \
      --tokens=$TOKENS --kv_heads=$KV_HEADS --head_dim=$HEAD_DIM --seed=$((s * 100 + r + 50))
  done
done

step "The store's index for chat-0 (older rounds spilled to RocksDB once RAM filled)"
"$KV" store ls --session=chat-0

step "Round recall: the upper segments of rounds 1, 3 and 5 of chat-0 in ONE GetSegments call"
"$KV" store get --session=chat-0 --refs=1:1,3:1,5:1

step "Store statistics"
"$KV" store stats

if command -v curl >/dev/null 2>&1; then
  step "A few Prometheus metrics"
  curl -s "127.0.0.1:$(cat "$WORK/mport")/metrics" | grep -E '^kvtier_store_(bytes|segments|hits_total|spills_total)' || true
fi

step "kill -9 the store, restart it, and read the same rounds back"
kill -9 "$STORE_PID"; wait "$STORE_PID" 2>/dev/null || true
start_store
"$KV" store ls --session=chat-0
"$KV" store get --session=chat-0 --refs=1:1,3:1,5:1

step "Done"
cat <<'MSG'
What ran: a real kvtier-store (gRPC on loopback, RocksDB on disk) driven by the kvtier CLI
with synthetic segments. `make demo` runs the whole tier: kvtier-worker serving multi-round
chats with round recall, in front of this store.
MSG
