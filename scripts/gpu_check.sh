#!/usr/bin/env bash
# kvtier's GPU checks, run on the GPU machine from the bundle that
# scripts/gpu_bundle.sh packs (it is copied there as run.sh):
#   1. kernels_cuda_test, worker_device_test and the GPU cases of
#      worker_speculation_test (the tests labelled gpu);
#   2. the demo with the worker's working sets on the GPU, then PD=1 (a
#      prefill worker hands each round to a decode worker, both on the GPU:
#      CUDA IPC), and with two GPUs PD=1 with a worker on each (NCCL);
#   3. kvtier-gpu-bench: the attention kernel against the device's copy
#      bandwidth, checked against a float64 reference; kvtier-bench
#      speculation: a speculating layer's time on the GPU against dense; 16
#      sessions decoded in one launch against one launch each; the
#      PD demo with IPC packing and without (ab.sh), three runs each.
# The summary ends with the measurements against their targets.
# Each step's log goes to $OUT when set (the device tool's folder), else to
# out/ beside this script; the last lines of each are printed, then a
# summary. Exits 1 when a step fails, or when a GPU test skipped (the device
# was not usable). DEMO_ROUNDS (default 8) sets the demo's rounds;
# STEP_TIMEOUT (default 180) the seconds a step may run before it is killed
# and counted as failed (exit 124), so that one hang leaves time for the rest.
# BENCH=0 leaves out the benches and the A/B (about 130 s on an H200).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVTIER_STORE_BINARY="$HERE/build/services/store/kvtier-store"
LOGS=${OUT:-$HERE/out}
mkdir -p "$LOGS"
echo "kvtier GPU checks, commit $(cat "$HERE/COMMIT" 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
SUMMARY=()
STATUS=0
run() {  # name, command...
  local name=$1
  shift
  local start=$SECONDS rc=0
  echo
  echo "== $name"
  timeout -k 10 "${STEP_TIMEOUT:-180}" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  local result=ok
  if [ "$rc" -ne 0 ]; then
    result="FAILED (exit $rc)"
    STATUS=1
  elif grep -q '^\[  SKIPPED \]' "$LOGS/$name.log"; then
    result="SKIPPED tests: the GPU was not usable"
    STATUS=1
  fi
  tail -n "${TAIL:-12}" "$LOGS/$name.log"
  SUMMARY+=("$name: $result, $((SECONDS - start)) s")
}
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
run kernels_cuda_test "$HERE/build/kernels/kernels_cuda_test"
if [ "${GPUS:-0}" -ge 2 ]; then
  run worker_device_test "$HERE/build/tests/worker_device_test"
else
  # The NCCL test needs two GPUs: on one it would skip, which here means failure.
  run worker_device_test "$HERE/build/tests/worker_device_test" \
    --gtest_filter=-*NcclLinks*
  SUMMARY+=("NCCL path: not checked ($GPUS GPU visible; it needs two)")
fi
# Speculation on the GPU (InfiniGen's two streams) against the CPU's.
run worker_speculation_gpu "$HERE/build/tests/worker_speculation_test" --gtest_filter=*OnTheGpu
run demo env ROUNDS="${DEMO_ROUNDS:-8}" bash "$HERE/scripts/demo.sh" "$HERE/build"
# With the hand-off's round layers packed (--ipc_pack_mib=256, the default;
# named so that the step packs whatever the default becomes).
run demo_pd env PD=1 ROUNDS="${DEMO_ROUNDS:-8}" WORKER_ARGS="--ipc_pack_mib=256 ${WORKER_ARGS:-}" \
  bash "$HERE/scripts/demo.sh" "$HERE/build"
# One conversation at a time: a hand-off's exposed part without the other
# sessions' hand-offs competing for the decode worker (docs/transfer.md).
run demo_pd_1 env PD=1 SESSIONS=1 ROUNDS="${DEMO_ROUNDS:-8}" bash "$HERE/scripts/demo.sh" "$HERE/build"
for log in demo demo_pd demo_pd_1; do
  if ! grep -q 'working sets: GPU' "$LOGS/$log.log"; then
    SUMMARY+=("$log: the working sets were not on the GPU (see its 'working sets:' line)")
    STATUS=1
  fi
done
for log in demo_pd demo_pd_1; do
  exposed=$(grep -o '[0-9.]* ms, [0-9.]* ms of it exposed ([0-9]*% hidden' "$LOGS/$log.log" | head -n 1)
  if [ -n "$exposed" ]; then SUMMARY+=("$log hand-off, per round: $exposed behind the prefill)"); fi
done
# Prefill on one worker and decode on another must return exactly one
# worker's outputs (the demo compares their digests).
for log in demo_pd demo_pd_1; do
  if grep -q '^outputs, disaggregated: bit-identical' "$LOGS/$log.log"; then
    SUMMARY+=("$log outputs: bit-identical to one worker's")
  else
    SUMMARY+=("$log outputs: not shown equal to one worker's (see its 'outputs, disaggregated' line)")
    STATUS=1
  fi
done
# Two worker processes on one GPU: their hand-offs copy the past rounds
# device to device (CUDA IPC) rather than over gRPC.
if ! grep -q 'copied device to device (CUDA IPC)' "$LOGS/demo_pd.log"; then
  SUMMARY+=("demo_pd: no hand-off took the CUDA IPC path (see its 'device path not taken' line)")
  STATUS=1
fi
# Two GPUs: a worker on each, so that their hand-offs go over NCCL, and
# later ones reuse the communicator the first formed.
if [ "${GPUS:-0}" -ge 2 ]; then
  run demo_pd_nccl env PD=1 PREFILL_GPU=0 DECODE_GPU=1 ROUNDS="${DEMO_ROUNDS:-8}" \
    bash "$HERE/scripts/demo.sh" "$HERE/build"
  if ! grep -q 'copied device to device (NCCL)' "$LOGS/demo_pd_nccl.log"; then
    SUMMARY+=("demo_pd_nccl: no hand-off took the NCCL path (see its 'device path not taken' line)")
    STATUS=1
  elif ! grep -q '^outputs, disaggregated: bit-identical' "$LOGS/demo_pd_nccl.log"; then
    SUMMARY+=("demo_pd_nccl: outputs not shown equal to one worker's")
    STATUS=1
  elif grep -q 'NCCL communicators: 0 of' "$LOGS/demo_pd_nccl.log"; then
    SUMMARY+=("demo_pd_nccl: no hand-off reused an NCCL communicator")
    STATUS=1
  fi
fi
if [ "${BENCH:-1}" = 0 ]; then
  SUMMARY+=("gpu_bench, spec_bench: not run (BENCH=0)")
else
  run gpu_bench "$HERE/build/bench/kvtier-gpu-bench" --csv="$LOGS/gpu_bench.csv"
  # 16 sessions' decode step in one launch against one launch a session.
  run gpu_batch "$HERE/build/bench/kvtier-gpu-bench" --batch=16x8192
  # Speculation's per-layer time on the GPU against dense attention there.
  run spec_bench "$HERE/build/bench/kvtier-bench" speculation --cpu=false
  # IPC packing A/B: the PD demo with the hand-offs' round layers packed
  # into a few allocations and not, three runs each, interleaved.
  if [ "${GPUS:-0}" -ge 1 ]; then
    run ipc_pack_ab bash "$HERE/ab.sh" --ipc_pack_mib=0 --ipc_pack_mib=256 3
  else
    SUMMARY+=("ipc_pack_ab: not run (no GPU; it measures the CUDA IPC path)")
  fi
fi
echo
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
# The measurements against their targets (docs/gpu.md), where they ran.
for log in gpu_bench gpu_batch; do
  if [ -f "$LOGS/$log.log" ] && grep -q '^Targets' "$LOGS/$log.log"; then
    echo
    sed -n '/^Targets/,/^$/p' "$LOGS/$log.log"
  fi
done
if [ -f "$LOGS/spec_bench.log" ] && grep -q '^| gpu speculation |' "$LOGS/spec_bench.log"; then
  echo "speculating layer against dense on the GPU (target <= 1.3x):"
  grep -E '^\| (gpu dense|gpu speculation) \|' "$LOGS/spec_bench.log"
fi
if [ -f "$LOGS/ipc_pack_ab.log" ] && grep -q '^A: ' "$LOGS/ipc_pack_ab.log"; then
  echo
  echo "IPC packing A/B (B packs; outputs must match one worker's in both):"
  sed -n '/^A: /,$p' "$LOGS/ipc_pack_ab.log"
fi
exit "$STATUS"
