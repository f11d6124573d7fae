#!/usr/bin/env bash
# scripts/gpu_bundle.sh packs the GPU checks for a machine without kvtier's
# Debian libraries: every library the bundled binaries load, other than the
# C/C++ runtime and the CUDA driver, must come from the bundle, and run.sh
# must run each step and say what happened. On a machine without a GPU the
# GPU tests skip and run.sh reports that (exit 1); a failing step is
# reported as FAILED. Skips when the build has no CUDA.
set -euo pipefail
BUILD_DIR=$(realpath "$1")
SRC_DIR=$(cd "$(dirname "$0")/.." && pwd)
if ! cmake --build "$BUILD_DIR" --target help | grep -c 'kvtier-gpu-bench' >/dev/null; then
  echo "skipping: this build has no CUDA (nvcc was not found at configure time)"
  exit 0
fi
T=$(mktemp -d /tmp/kvtier-gpu-bundle-test-XXXXXX)
trap 'rm -rf "$T"' EXIT
"$SRC_DIR/scripts/gpu_bundle.sh" "$BUILD_DIR" "$T/made" >"$T/bundle.log"
grep -q "gpu-bundle.tar.xz" "$T/bundle.log"
mkdir "$T/there"
tar xJf "$T/made/gpu-bundle.tar.xz" -C "$T/there"
B="$T/there/gpu-bundle"
for bin in "$B"/build/*/kvtier-* "$B"/build/*/*/kvtier-* "$B"/build/*/*_test; do
  [ -x "$bin" ] || continue
  outside=$(LD_LIBRARY_PATH="$B/lib" ldd "$bin" | awk '$2 == "=>" {print $3}' |
    grep -v "^$B/lib/" |
    grep -v -E '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcuda)\.so' || true)
  if [ -n "$outside" ]; then
    echo "$bin loads libraries from outside the bundle:"
    echo "$outside"
    exit 1
  fi
done
expect_rc=1  # No GPU here: the GPU tests skip, and run.sh says so.
if nvidia-smi -L >/dev/null 2>&1; then expect_rc=0; fi
rc=0
OUT="$T/out" DEMO_ROUNDS=2 "$B/run.sh" >"$T/run.log" 2>&1 || rc=$?
if [ "$rc" -ne "$expect_rc" ]; then
  echo "run.sh exited $rc, expected $expect_rc:"
  tail -30 "$T/run.log"
  exit 1
fi
for step in kernels_cuda_test worker_device_test worker_speculation_gpu demo demo_pd demo_pd_1 gpu_bench spec_bench; do
  [ -s "$T/out/$step.log" ] || { echo "no log of $step"; exit 1; }
done
grep -q "^demo: ok" "$T/run.log"
grep -q "^demo_pd: ok" "$T/run.log"
grep -q "^demo_pd_1: ok" "$T/run.log"
grep -q "^demo_pd_1 hand-off, per round: [0-9.]* ms, [0-9.]* ms of it exposed" "$T/run.log"
grep -q "^gpu_bench: ok" "$T/run.log"
grep -q "^spec_bench: ok" "$T/run.log"
# The PD demos' outputs against one worker's (on the CPU here too).
grep -q "^demo_pd outputs: bit-identical to one worker's" "$T/run.log" || { tail -30 "$T/run.log"; exit 1; }
grep -q "^demo_pd_1 outputs: bit-identical to one worker's" "$T/run.log"
# ab.sh (scripts/pd_ab.sh) runs from the bundle, its libraries included.
SESSIONS=1 ROUNDS=2 "$B/ab.sh" "" "--device_cache_mib=0" 1 >"$T/ab.log" 2>&1 ||
  { cat "$T/ab.log"; exit 1; }
grep -q "^| ttft PD ms " "$T/ab.log" || { cat "$T/ab.log"; exit 1; }
grep -q " bit-identical " "$T/ab.log"
if [ "$expect_rc" -eq 1 ]; then
  grep -q "^kernels_cuda_test: SKIPPED tests: the GPU was not usable" "$T/run.log"
  grep -q "^worker_device_test: SKIPPED tests: the GPU was not usable" "$T/run.log"
  grep -q "^worker_speculation_gpu: SKIPPED tests: the GPU was not usable" "$T/run.log"
  grep -q "^demo: the working sets were not on the GPU" "$T/run.log"
  grep -q "^demo_pd: no hand-off took the CUDA IPC path" "$T/run.log"
  grep -q "nothing to measure" "$T/out/gpu_bench.log"
fi
# A step that fails is reported as such.
printf '#!/bin/sh\necho broken\nexit 3\n' >"$B/build/kernels/kernels_cuda_test"
rc=0
OUT="$T/out2" DEMO_ROUNDS=2 "$B/run.sh" >"$T/run2.log" 2>&1 || rc=$?
[ "$rc" -eq 1 ] || { echo "a failing step left run.sh with exit $rc"; exit 1; }
grep -q "^kernels_cuda_test: FAILED (exit 3)" "$T/run2.log"
echo "gpu bundle OK"
