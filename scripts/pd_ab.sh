#!/usr/bin/env bash
# A/B of kvtier-worker flags on the prefill/decode demo: runs `PD=1` with
# WORKER_ARGS=A, then with B, PAIRS times, interleaved so that drift hits
# both alike, and prints one line per run and a table of medians: the
# hand-off's time and exposed part, time to first token (disaggregated and
# one worker), how busy the decode worker was, whether the outputs were
# bit-identical to one worker's, and the decode worker's CUDA calls (IPC
# opens, cudaMalloc) where it has a GPU. Exits 1 when a run fails or its
# outputs differ.
#
# Usage: scripts/pd_ab.sh "FLAGS A" "FLAGS B" [PAIRS [BUILD_DIR]]
#   e.g. scripts/pd_ab.sh --ipc_pack_mib=0 --ipc_pack_mib=256 3
# SESSIONS and ROUNDS pass to the demo (default 4 and 8); the GPU bundle
# holds this script as ab.sh (docs/gpu.md).
set -uo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
fi
A=$1
B=$2
PAIRS=${3:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -n "${4:-}" ]; then
  BUILD_DIR=$4
elif [ -d "$HERE/build" ]; then
  BUILD_DIR="$HERE/build"  # In the GPU bundle.
else
  BUILD_DIR="$HERE/../build"
fi
if [ -d "$HERE/lib" ]; then  # The GPU bundle's libraries, as run.sh sets them.
  export LD_LIBRARY_PATH="$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export KVTIER_STORE_BINARY="$HERE/build/services/store/kvtier-store"
fi
DEMO="$HERE/scripts/demo.sh"
[ -f "$DEMO" ] || DEMO="$HERE/demo.sh"
LOGS=$(mktemp -d /tmp/kvtier-pd-ab-XXXXXX)
trap 'rm -rf "$LOGS"' EXIT
STATUS=0

num() {  # pattern (with one group of digits) in file -> the number, or "-"
  local v
  v=$(grep -o -E "$1" "$2" | head -n 1 | grep -o -E '[0-9]+(\.[0-9]+)?' | head -n 1)
  echo "${v:--}"
}
# The decode worker's counter `call` (its metrics come after its heading).
decode_calls() {
  local v
  v=$(awk -v c="$1" '/The decode kvtier-worker/ {d = 1}
    d && index($0, "kvtier_worker_device_calls_total{call=\"" c "\"}") == 1 {print $2; exit}' "$2")
  echo "${v:--}"
}

COLS=("hand-off ms" "exposed ms" "ttft PD ms" "ttft one ms" "busy ms" "ipc_open" "cudaMalloc")
printf '%-4s %-3s %10s %10s %10s %11s %8s %-14s %8s %10s\n' run set "hand-off" exposed \
  "ttft PD" "ttft one" busy outputs ipc_open cudaMalloc
for i in $(seq 1 "$PAIRS"); do
  for set in A B; do
    flags=$A
    [ "$set" = B ] && flags=$B
    log="$LOGS/${set}_$i.log"
    rc=0
    env PD=1 SESSIONS="${SESSIONS:-4}" ROUNDS="${ROUNDS:-8}" WORKER_ARGS="$flags" \
      bash "$DEMO" "$BUILD_DIR" >"$log" 2>&1 || rc=$?
    outputs=$(grep -o -E '^outputs, disaggregated: (bit-identical|DIFFER)' "$log" | grep -o -E '[a-zA-Z-]+$')
    [ -z "$outputs" ] && outputs="-"
    if [ "$rc" -ne 0 ] || [ "$outputs" != bit-identical ]; then
      STATUS=1
      echo "run $i ($set: $flags) failed (exit $rc, outputs $outputs); its last lines:" >&2
      tail -n 15 "$log" >&2
    fi
    row=("$(num '[0-9.]+ ms, [0-9.]+ ms of it exposed' "$log")"
      "$(num 'ms, [0-9.]+ ms of it exposed' "$log")"
      "$(num 'time to first token, disaggregated: +[0-9.]+' "$log")"
      "$(num 'time to first token, one worker: +[0-9.]+' "$log")"
      "$(num 'busy for [0-9.]+ ms' "$log")"
      "$(decode_calls ipc_open "$log")" "$(decode_calls alloc "$log")")
    echo "$set ${row[*]}" >>"$LOGS/rows"
    printf '%-4s %-3s %10s %10s %10s %11s %8s %-14s %8s %10s\n' "$i" "$set" "${row[0]}" \
      "${row[1]}" "${row[2]}" "${row[3]}" "${row[4]}" "$outputs" "${row[5]}" "${row[6]}"
  done
done
echo
echo "A: ${A:-(no flags)}"
echo "B: ${B:-(no flags)}"
echo "medians of $PAIRS runs each:"
printf '| %-12s | %-10s | %-10s |\n' "" A B
printf '|---|---|---|\n'
for c in "${!COLS[@]}"; do
  med() {
    awk -v s="$1" -v c=$((c + 2)) '$1 == s && $c ~ /^[0-9.]+$/ {print $c}' "$LOGS/rows" | sort -g |
      awk '{a[NR] = $1} END {print NR ? a[int((NR + 1) / 2)] : "-"}'
  }
  printf '| %-12s | %-10s | %-10s |\n' "${COLS[$c]}" "$(med A)" "$(med B)"
done
exit "$STATUS"
