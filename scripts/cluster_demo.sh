#!/usr/bin/env bash
# `make demo-cluster`: kvtier as a cluster on this machine. Starts
# kvtier-controller (R = 2), three kvtier-stores and two kvtier-workers that
# join it, serves the demo's multi-round chats through them twice (routed by
# the controller), and in the second run kills one store and one worker with
# SIGKILL partway through. Reports where each session lives, the failovers,
# the repair, and the fidelity of both runs (docs/cluster.md).
#   scripts/cluster_demo.sh [BUILD_DIR]
# Environment: SESSIONS (4), ROUNDS (24), CODEC (raw), MODEL (empty: the
# synthetic chat), KILL_STORE_AT (after 8 rounds), KILL_WORKER_AT (after 16 rounds),
# TLS (0; 1: every connection is mutual TLS with certificates of a throwaway
# CA, scripts/make_test_certs.sh, and a client without one is shown refused).
set -euo pipefail
BUILD_DIR=${1:-build}
BIN_CONTROLLER="$BUILD_DIR/services/controller/kvtier-controller"
BIN_STORE="$BUILD_DIR/services/store/kvtier-store"
BIN_WORKER="$BUILD_DIR/services/worker/kvtier-worker"
BIN_ENGINE="$BUILD_DIR/refengine/kvtier-engine"
SESSIONS=${SESSIONS:-4}
ROUNDS=${ROUNDS:-24}
CODEC=${CODEC:-raw}
MODEL=${MODEL:-}
KILL_STORE_AT=${KILL_STORE_AT:-8}
KILL_WORKER_AT=${KILL_WORKER_AT:-16}
TLS=${TLS:-0}
for at in "$KILL_STORE_AT" "$KILL_WORKER_AT"; do
  if ! [[ $at =~ ^[0-9]+$ ]] || [ "$at" -lt 1 ] || [ "$at" -gt "$ROUNDS" ]; then
    echo "KILL_STORE_AT=$KILL_STORE_AT KILL_WORKER_AT=$KILL_WORKER_AT: each must be a round from 1 to ROUNDS=$ROUNDS"
    exit 2
  fi
done
WORK=$(mktemp -d /tmp/kvtier-cluster-XXXXXX)
declare -A PID
cleanup() {
  for p in "${PID[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }
wait_file() {  # file, log, name
  for _ in $(seq 300); do [ -s "$1" ] && return; sleep 0.05; done
  echo "$3 did not start:"; tail "$2"; exit 1
}
metric() {  # port, regex: prints matching lines of /metrics
  if command -v curl >/dev/null 2>&1; then
    curl -s "127.0.0.1:$1/metrics" | grep -E "$2" || true
  fi
}

for b in "$BIN_CONTROLLER" "$BIN_STORE" "$BIN_WORKER" "$BIN_ENGINE"; do
  [ -x "$b" ] || { echo "missing $b: run make build first"; exit 1; }
done

# TLS=1: each server serves TLS and requires a client certificate from the
# demo's CA; each process presents its own (node_tls NAME: a node's flags).
CONTROLLER_TLS=() WORKER_TLS=() ENGINE_TLS=()
node_tls() { :; }
if [ "$TLS" = 1 ]; then
  T="$WORK/tls"
  "$(dirname "$0")/make_test_certs.sh" "$T" controller store-1 store-2 store-3 worker-1 worker-2 engine
  CONTROLLER_TLS=(--tls_cert="$T/controller.pem" --tls_key="$T/controller.key"
    --tls_client_ca="$T/ca.pem" --store_tls_root_certs="$T/ca.pem"
    --tls_client_cert="$T/controller.pem" --tls_client_key="$T/controller.key")
  node_tls() {
    echo "--tls_cert=$T/$1.pem --tls_key=$T/$1.key --tls_client_ca=$T/ca.pem" \
      "--controller_tls_root_certs=$T/ca.pem --tls_client_cert=$T/$1.pem --tls_client_key=$T/$1.key"
  }
  WORKER_TLS=(--store_tls_root_certs="$T/ca.pem" --peer_tls_root_certs="$T/ca.pem")
  ENGINE_TLS=(--controller_tls_root_certs="$T/ca.pem" --worker_tls_root_certs="$T/ca.pem"
    --tls_client_cert="$T/engine.pem" --tls_client_key="$T/engine.key")
elif [ "$TLS" != 0 ]; then
  echo "TLS=$TLS: 0 or 1"; exit 2
fi

step "Starting kvtier-controller (R = 2 store replicas, heartbeats every 200 ms, lease 600 ms)"
"$BIN_CONTROLLER" --listen=127.0.0.1:0 --port_file="$WORK/controller.port" --replicas=2 \
  --heartbeat_interval_ms=200 --warmup_seconds=2 --metrics_listen=127.0.0.1:0 \
  --metrics_port_file="$WORK/controller.mport" "${CONTROLLER_TLS[@]}" 2>>"$WORK/controller.log" &
PID[controller]=$!
wait_file "$WORK/controller.port" "$WORK/controller.log" kvtier-controller
CONTROLLER=127.0.0.1:$(cat "$WORK/controller.port")
echo "kvtier-controller on $CONTROLLER"

step "Starting 3 kvtier-stores and 2 kvtier-workers that join it"
for i in 1 2 3; do
  "$BIN_STORE" --data_dir="$WORK/store-$i" --listen=127.0.0.1:0 --port_file="$WORK/store-$i.port" \
    --metrics_listen=127.0.0.1:0 --controller="$CONTROLLER" --node_id="store-$i" \
    $(node_tls "store-$i") 2>>"$WORK/store-$i.log" &
  PID[store-$i]=$!
  wait_file "$WORK/store-$i.port" "$WORK/store-$i.log" "store-$i"
  echo "store-$i on 127.0.0.1:$(cat "$WORK/store-$i.port")"
done
for i in 1 2; do
  "$BIN_WORKER" --store="127.0.0.1:$(cat "$WORK/store-$i.port")" --listen=127.0.0.1:0 \
    --port_file="$WORK/worker-$i.port" --metrics_listen=127.0.0.1:0 \
    --metrics_port_file="$WORK/worker-$i.mport" --controller="$CONTROLLER" \
    --node_id="worker-$i" $(node_tls "worker-$i") "${WORKER_TLS[@]}" 2>>"$WORK/worker-$i.log" &
  PID[worker-$i]=$!
  wait_file "$WORK/worker-$i.port" "$WORK/worker-$i.log" "worker-$i"
  echo "worker-$i on 127.0.0.1:$(cat "$WORK/worker-$i.port")"
done
MPORT=$(cat "$WORK/controller.mport")
for _ in $(seq 100); do
  live=$(metric "$MPORT" '^kvtier_controller_nodes\{.*state="live"' | awk '{s += $2} END {print s + 0}')
  [ "$live" = 5 ] && break
  sleep 0.1
done
echo "live nodes: $live of 5; waiting 2 s for their warm-up"
sleep 2

if [ "$TLS" = 1 ]; then
  step "Mutual TLS: every connection above presents a certificate of the demo's CA"
  # A client that trusts the CA but presents no certificate of its own.
  if out=$("$BUILD_DIR/tools/kvtier" store stats --target="127.0.0.1:$(cat "$WORK/store-1.port")" \
      --tls_ca="$T/ca.pem" 2>&1); then
    echo "store-1 served a client without a certificate:"; echo "$out"; exit 1
  fi
  echo "a client without a certificate is refused: $(echo "$out" | tail -n 1)"
fi

ARGS=(--controller="$CONTROLLER" --sessions="$SESSIONS" --rounds="$ROUNDS" --codec="$CODEC"
  "${ENGINE_TLS[@]}")
[ -n "$MODEL" ] && ARGS+=(--model="$MODEL")

step "Run 1: $SESSIONS conversations x $ROUNDS rounds, no failures (the baseline)"
"$BIN_ENGINE" "${ARGS[@]}" --quiet --session_prefix=base- >"$WORK/run1.txt" 2>"$WORK/run1.err" ||
  { cat "$WORK/run1.txt" "$WORK/run1.err"; exit 1; }
grep -E '^fidelity|^decode' "$WORK/run1.txt"

step "Run 2: the same conversations; store-1 is killed after $KILL_STORE_AT rounds, worker-1 after $KILL_WORKER_AT"
"$BIN_ENGINE" "${ARGS[@]}" --session_prefix=fail- >"$WORK/run2.txt" 2>"$WORK/run2.err" &
ENGINE=$!
killed_store=0
killed_worker=0
while kill -0 "$ENGINE" 2>/dev/null; do
  if [ $killed_store = 0 ] && grep -q " ($KILL_STORE_AT of " "$WORK/run2.txt"; then
    { kill -9 "${PID[store-1]}" && wait "${PID[store-1]}"; } 2>/dev/null || true
    echo "$(date +%T.%3N) kill -9 store-1"
    killed_store=1
  fi
  if [ $killed_worker = 0 ] && grep -q " ($KILL_WORKER_AT of " "$WORK/run2.txt"; then
    { kill -9 "${PID[worker-1]}" && wait "${PID[worker-1]}"; } 2>/dev/null || true
    echo "$(date +%T.%3N) kill -9 worker-1"
    killed_worker=1
  fi
  sleep 0.05
done
if ! wait "$ENGINE"; then
  echo "the engine failed:"; tail -n 20 "$WORK/run2.txt" "$WORK/run2.err"; exit 1
fi
if [ $killed_store = 0 ] || [ $killed_worker = 0 ]; then
  # Run 2 would then show nothing of what it claims: say so rather than report it.
  [ $killed_store = 0 ] && echo "store-1 was never killed: no progress line had \" ($KILL_STORE_AT of \""
  [ $killed_worker = 0 ] && echo "worker-1 was never killed: no progress line had \" ($KILL_WORKER_AT of \""
  exit 1
fi
grep -E 'sending the round again|the round was stored' "$WORK/run2.txt" | sed 's/^/  /' || true
sed -n '/^cluster placement/,$p' "$WORK/run2.txt"

step "Repair (the controller copies the dead store's sessions to their new replica)"
for _ in $(seq 100); do
  pending=$(metric "$MPORT" '^kvtier_controller_repairs_pending ' | awk '{print $2 + 0}')
  [ "${pending:-0}" = 0 ] && break
  sleep 0.1
done
metric "$MPORT" '^kvtier_controller_(repair_total|repairs_pending|under_replicated|nodes_declared_dead)'
# (Every repair may have been a skip: grep then finds nothing, which is fine.)
{ grep -h '"repair done"' "$WORK/controller.log" || true; } | head -3 | sed 's/^/  /'
echo "  ($(grep -c '"repair done"' "$WORK/controller.log") sessions copied in all;" \
  "$(grep -c '"repair skipped' "$WORK/controller.log") more had no round stored yet)"
stored=0
for i in 1 2; do
  if [ -s "$WORK/worker-$i.mport" ]; then
    b=$(metric "$(cat "$WORK/worker-$i.mport")" '^kvtier_worker_bytes_stored_total' |
      awk '{s += $2} END {print s + 0}')
    stored=$((stored + ${b:-0}))
  fi
done
[ "$stored" != 0 ] && echo "bytes the live worker stored (each to 2 replicas): $stored"

step "Fidelity: unchanged by the failures?"
f1=$(grep '^fidelity' "$WORK/run1.txt")
f2=$(grep '^fidelity' "$WORK/run2.txt")
echo "no failures:   $f1"
echo "with failures: $f2"
if [ "$f1" = "$f2" ]; then
  echo "identical: the failures cost time, not fidelity"
else
  echo "DIFFERENT: the failures changed what the sessions attended to"
  exit 1
fi
