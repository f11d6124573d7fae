#!/usr/bin/env bash
# Packs kvtier's GPU checks for a machine that has a GPU and CUDA but none of
# kvtier's Debian libraries (and no package registry to fetch them): the
# binaries built here, stripped, with every shared library they load except
# the C/C++ runtime and the CUDA driver, the demo script and the runner
# (scripts/gpu_check.sh, as run.sh). Writes gpu-bundle.tar.xz in the
# repository root (ignored by git). On the GPU machine:
#
#   tar xJf gpu-bundle.tar.xz && gpu-bundle/run.sh
#
# docs/gpu.md says what it runs and how to read it.
#
# Usage: scripts/gpu_bundle.sh [BUILD_DIR [DEST]]
#   BUILD_DIR  a build configured with CUDA [build]
#   DEST       where gpu-bundle/ and gpu-bundle.tar.xz go [the repository root]
set -euo pipefail
BUILD_DIR=$(realpath -m "${1:-build}")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=$(realpath -m "${2:-$ROOT}")
cd "$ROOT"
BINARIES=(
  kernels/kernels_cuda_test
  tests/worker_device_test
  tests/worker_speculation_test
  services/store/kvtier-store
  services/worker/kvtier-worker
  refengine/kvtier-engine
  bench/kvtier-gpu-bench
  bench/kvtier-bench
)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  echo "gpu_bundle: $BUILD_DIR is not a configured build (make build first)" >&2
  exit 2
fi
if ! cmake --build "$BUILD_DIR" --target help | grep -c 'kvtier-gpu-bench' >/dev/null; then
  echo "gpu_bundle: $BUILD_DIR was configured without CUDA; nothing to check on a GPU" >&2
  exit 2
fi
targets=()
for b in "${BINARIES[@]}"; do targets+=("$(basename "$b")"); done
echo "Building ${targets[*]}"
cmake --build "$BUILD_DIR" -j"$(nproc)" --target "${targets[@]}" >/dev/null

B="$DEST/gpu-bundle"
rm -rf "$B" "$B.tar.xz"
mkdir -p "$B/lib" "$B/scripts"
for b in "${BINARIES[@]}"; do
  mkdir -p "$B/build/$(dirname "$b")"
  strip --strip-debug -o "$B/build/$b" "$BUILD_DIR/$b"
done
cp scripts/demo.sh "$B/scripts/demo.sh"
cp scripts/gpu_check.sh "$B/run.sh"
cp scripts/gpu_profile.sh "$B/profile.sh"
cp scripts/pd_ab.sh "$B/ab.sh"
# The libraries: what ldd resolves, less the runtime every Linux has (and
# whose newer versions load older programs) and the driver's own libcuda.
for b in "${BINARIES[@]}"; do ldd "$B/build/$b"; done |
  awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcuda|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$B/lib/"; done
missing=$(for b in "${BINARIES[@]}"; do ldd "$B/build/$b"; done | grep 'not found' || true)
if [ -n "$missing" ]; then
  echo "gpu_bundle: unresolved libraries:" >&2
  echo "$missing" >&2
  exit 1
fi
git rev-parse --short HEAD >"$B/COMMIT" 2>/dev/null || echo unknown >"$B/COMMIT"
# xz: a third smaller than gzip (42 MB against 64 MB on 2026-11-28).
tar cf - -C "$DEST" gpu-bundle | xz -T0 -6 >"$B.tar.xz"
echo "$B.tar.xz: $(du -h "$B.tar.xz" | cut -f1) ($(ls "$B/lib" | wc -l) libraries," \
  "commit $(cat "$B/COMMIT")); on the GPU machine: tar xJf gpu-bundle.tar.xz && gpu-bundle/run.sh"
