#!/usr/bin/env bash
# `make demo`'s script end to end, small: real kvtier-store and kvtier-worker
# processes, kvtier-engine, the text report and every required JSON key.
set -euo pipefail
BUILD_DIR=$1
SRC_DIR=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mktemp -d /tmp/kvtier-demo-test-XXXXXX)
trap 'rm -rf "$OUT"' EXIT
SESSIONS=2 ROUNDS=20 CODEC=kivi8 REPORT="$OUT/report.json" \
  "$SRC_DIR/scripts/demo.sh" "$BUILD_DIR" >"$OUT/stdout" 2>&1 || {
  cat "$OUT/stdout"
  exit 1
}
grep -q "== kvtier demo report: synthetic-chat" "$OUT/stdout" || { cat "$OUT/stdout"; exit 1; }
grep -q "attention-output relative error" "$OUT/stdout"
grep -q "kvtier-worker memory (largest worker): peak RSS" "$OUT/stdout"
grep -q "kvtier-store memory: RSS" "$OUT/stdout"
for key in sessions rounds full_cache_bytes working_set_bytes working_set_ratio store_bytes_ram \
  store_bytes_disk recall_calls recall_rounds_selected decode_ms_per_token attn_rel_err \
  top1_agreement worker_memory store_memory working_set_peak_sum_bytes; do
  grep -q "\"$key\": " "$OUT/report.json" || { echo "missing key $key"; cat "$OUT/report.json"; exit 1; }
done
grep -q '"sessions": 2,' "$OUT/report.json"
grep -q '"rounds": 20,' "$OUT/report.json"
grep -q '"recall_calls": 38,' "$OUT/report.json"
grep -q '"top1_agreement": null,' "$OUT/report.json"
grep -qE '"outputs_crc32c": [0-9]+,' "$OUT/report.json"

# PD=1: prefill on one kvtier-worker, decode on a second, each round handed
# off; the outputs must be bit-identical to one worker's (the script
# compares the two runs' digests and exits 1 when they differ).
PD=1 SESSIONS=2 ROUNDS=4 CODEC=kivi4 "$SRC_DIR/scripts/demo.sh" "$BUILD_DIR" >"$OUT/pd" 2>&1 || {
  cat "$OUT/pd"
  exit 1
}
grep -q "^outputs, disaggregated: bit-identical to one worker's (digest [0-9a-f]*)" "$OUT/pd" ||
  { cat "$OUT/pd"; exit 1; }
grep -q "^prefill -> decode hand-off" "$OUT/pd" || { cat "$OUT/pd"; exit 1; }

# TLS=1 PD=1: the same over mutual TLS (each process presents a certificate
# of a throwaway CA; the servers require one), still bit-identical.
TLS=1 PD=1 SESSIONS=2 ROUNDS=3 "$SRC_DIR/scripts/demo.sh" "$BUILD_DIR" >"$OUT/tls" 2>&1 || {
  cat "$OUT/tls"
  exit 1
}
grep -q "^mutual TLS: store, workers and engine each present a certificate" "$OUT/tls" ||
  { cat "$OUT/tls"; exit 1; }
grep -q "^outputs, disaggregated: bit-identical to one worker's" "$OUT/tls" ||
  { cat "$OUT/tls"; exit 1; }

if command -v gnuplot >/dev/null 2>&1; then
  "$BUILD_DIR/tools/kvtier" plot demo "$OUT/report.json" --out="$OUT/ws.svg" >/dev/null
  grep -q "working set against the full cache, per round" "$OUT/ws.svg"
fi

# CONVERSATIONS=file: the sample conversations replayed on stories260K.
MODEL_PATH="$SRC_DIR/../shared/models/stories260K.bin"
if [ -f "$MODEL_PATH" ]; then
  SESSIONS=2 CONVERSATIONS="$SRC_DIR/traces/stories260k_chats.jsonl" MODEL="$MODEL_PATH" \
    REPORT="$OUT/replay.json" "$SRC_DIR/scripts/demo.sh" "$BUILD_DIR" >"$OUT/replay" 2>&1 || {
    cat "$OUT/replay"
    exit 1
  }
  grep -q "4 conversations replayed from .*stories260k_chats.jsonl" "$OUT/replay" ||
    { cat "$OUT/replay"; exit 1; }
  grep -q "accuracy on the scored spans" "$OUT/replay"
  grep -q '"replay": {"file": ' "$OUT/replay.json"
  # SPEC=4: the skew calibrated first, uploaded, and every speculating layer
  # reported, with a budget of 8 tokens per head and a host pool of 16 KiB.
  SESSIONS=2 SPEC=4:8:16384 CONVERSATIONS="$SRC_DIR/traces/stories260k_chats.jsonl" MODEL="$MODEL_PATH" \
    REPORT="$OUT/spec.json" "$SRC_DIR/scripts/demo.sh" "$BUILD_DIR" >"$OUT/spec" 2>&1 || {
    cat "$OUT/spec"
    exit 1
  }
  grep -q "Calibrating the InfiniGen skew" "$OUT/spec" || { cat "$OUT/spec"; exit 1; }
  grep -q "^speculation (4:8:16384), per decode step" "$OUT/spec" || { cat "$OUT/spec"; exit 1; }
  grep -q "^host pool (cap 16.0 KiB per session, layers 1..4): " "$OUT/spec" ||
    { cat "$OUT/spec"; exit 1; }
  grep -qE '^4 +912 ' "$OUT/spec" || { cat "$OUT/spec"; exit 1; }
  grep -q 'kvtier_worker_speculation_steps_total{layer="1"} 912' "$OUT/spec"
  grep -q '"speculation": {"setting": "4:8:16384", "sessions_on_gpu": [0-9]*, "layers": \[{"layer": 0, "steps": 0' "$OUT/spec.json"
  # kept per head is capped by the budget of 8.
  python3 - "$OUT/spec.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
layers = r["speculation"]["layers"]
assert all(l["kept_per_head_mean"] <= 8 for l in layers[1:]), layers
assert all(0 < l["hit_rate"] <= 1 for l in layers[1:]), layers
pool = r["speculation"]["pool"]
assert pool["cap_bytes"] == 16384 and pool["evicted_tokens"] > 0, pool
assert pool["trims"] > 0 and pool["max_bytes_after"] < pool["max_bytes_before"], pool
PY
  # MODE=inproc: the worker engine in kvtier-engine, then the same run remote.
  MODE=inproc ROUNDS=4 SESSIONS=2 MODEL="$MODEL_PATH" "$SRC_DIR/scripts/demo.sh" "$BUILD_DIR" \
    >"$OUT/inproc" 2>&1 || { cat "$OUT/inproc"; exit 1; }
  grep -q "with the worker engine in this process (the store remote)" "$OUT/inproc" ||
    { cat "$OUT/inproc"; exit 1; }
  grep -qE "^decode, through kvtier-worker: +[0-9.]+ ms" "$OUT/inproc" || { cat "$OUT/inproc"; exit 1; }
  SPEC=0 MODEL="$MODEL_PATH" "$SRC_DIR/scripts/demo.sh" "$BUILD_DIR" >"$OUT/spec0" 2>&1 &&
    { echo "SPEC=0 was accepted"; cat "$OUT/spec0"; exit 1; }
  grep -q "speculation '0': expected ALPHA\[:BUDGET\[:POOL_BYTES\[:LOW_BYTES\]\]\]" "$OUT/spec0" || { cat "$OUT/spec0"; exit 1; }
elif [ "${CI:-}" = true ]; then
  echo "CI=true but $MODEL_PATH is missing"
  exit 1
else
  echo "skipping the CONVERSATIONS run: needs ../shared/models/stories260K.bin beside the checkout"
fi
echo "demo script OK"
