#!/usr/bin/env bash
# Nsight Compute over one timed launch of the decode-attention span kernel
# (kvtier-gpu-bench's default path), on the GPU machine, from the bundle
# (copied there as profile.sh beside run.sh; docs/gpu.md):
#   gpu-bundle/profile.sh [CODEC [TOKENS [PREFETCH]]]     # kivi4 32768 default
# Prints the speed-of-light, occupancy, memory, scheduler, instruction and
# warp-stall sections (with each stall reason's cycles per issue) of the
# kernel's fifth launch (after the bench's check and three warm-ups), or with
# PREFETCH, of its first timed launch at that prefetch distance. Needs ncu on
# PATH or under /opt/nvidia/nsight-compute.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)
if [ -z "$NCU" ]; then
  echo "profile.sh: no ncu on this machine" >&2
  exit 2
fi
CODEC=${1:-kivi4}
TOKENS=${2:-32768}
ARGS=(--tokens="$TOKENS" --codecs="$CODEC" --reps=1 --general=false)
if [ -n "${3:-}" ]; then
  # The sweep's launches come after the default's five: profile the sweep's.
  ARGS+=(--prefetch="$3")
  SKIP=9
else
  SKIP=4
fi
exec "$NCU" --clock-control none -k "regex:Split(Vec|Mma)Kernel" --launch-skip "$SKIP" --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section InstructionStats --section SourceCounters \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
  "$HERE/build/bench/kvtier-gpu-bench" "${ARGS[@]}"
