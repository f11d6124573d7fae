#!/usr/bin/env bash
# `make fuzz`: builds every fuzz target (fuzz/) as a libFuzzer binary with
# clang, AddressSanitizer and UBSan in build-fuzz/, seeds a corpus per target
# from the targets' own seeds, and fuzzes each for FUZZ_SECONDS (default 60).
# A crash stops the run and leaves the input in build-fuzz/crashes/TARGET/.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-fuzz}
SECONDS_EACH=${FUZZ_SECONDS:-60}
JOBS=${JOBS:-$(nproc)}
scripts/kvtier.sh deps
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVTIER_FUZZ=ON -DKVTIER_SANITIZE=address -DKVTIER_CUDA=OFF -DKVTIER_BUILD_TESTS=OFF \
  -DKVTIER_BUILD_BENCH=OFF
cmake --build "$BUILD_DIR" -j "$JOBS" --target fuzz_targets
for bin in "$BUILD_DIR"/fuzz/*_fuzz; do
  t=$(basename "$bin" _fuzz)
  corpus="$BUILD_DIR/corpus/$t"
  crashes="$BUILD_DIR/crashes/$t"
  mkdir -p "$corpus" "$crashes"
  # Inputs an earlier run left: still failing stops the run here; fixed ones
  # move to fixed/, so that they do not fail this run.
  for old in $(find "$crashes" -maxdepth 1 -type f | sort); do
    if "$BUILD_DIR/fuzz/${t}_fuzz" "$old" >/dev/null 2>&1; then
      mkdir -p "$crashes/fixed"
      mv "$old" "$crashes/fixed/"
      echo "fuzz: $t: $(basename "$old") from an earlier run passes now (moved to $crashes/fixed/)"
    else
      echo "fuzz: $t still fails on $old (replay: $BUILD_DIR/fuzz/${t}_fuzz $old)" >&2
      exit 1
    fi
  done
  KVTIER_FUZZ_WRITE_SEEDS="$corpus" "$BUILD_DIR/fuzz/${t}_fuzz" >/dev/null
  echo "== fuzzing $t for ${SECONDS_EACH}s (corpus $corpus)"
  # The whole output (the sanitizer's report with its stacks) goes to a log;
  # the summary lines to the terminal.
  log="$BUILD_DIR/fuzz-logs/$t.log"
  mkdir -p "$BUILD_DIR/fuzz-logs"
  # The targets that start real gRPC servers check for leaks once, at exit,
  # rather than after every input: gRPC's own threads build and tear down
  # channels and threads in the background, and a check landing mid-way
  # reports their half-made objects (a channel, a starting thread's
  # arguments: once in 5,000-15,000 inputs of controller_request).
  leaks=1
  case $t in controller_request | store_upload) leaks=0 ;; esac
  rc=0
  "$BUILD_DIR/fuzz/${t}_fuzz" "$corpus" -max_total_time="$SECONDS_EACH" -print_final_stats=1 \
    -artifact_prefix="$crashes/" -rss_limit_mb=4096 -detect_leaks=$leaks >"$log" 2>&1 || rc=$?
  grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|SUMMARY|==[0-9]+==ERROR)" "$log" || true
  if [ -n "$(find "$crashes" -maxdepth 1 -type f)" ]; then
    echo "fuzz: $t crashed; inputs in $crashes (replay: $BUILD_DIR/fuzz/${t}_fuzz FILE), the report in $log" >&2
    exit 1
  fi
  if [ "$rc" != 0 ]; then
    # No input to blame: a leak found at exit, or the fuzzer itself failing.
    echo "fuzz: $t exited with status $rc after fuzzing; the report in $log" >&2
    exit 1
  fi
done
echo "fuzz: every target ran ${SECONDS_EACH}s without a crash"
