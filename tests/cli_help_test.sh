#!/usr/bin/env bash
# `--help` on every service binary lists that binary's own flags with their
# defaults (not absl's "No flags matched"), with paths relative to the
# project, and exits 0; an unknown flag is one line naming it, and a failure
# exit.
set -euo pipefail
BUILD_DIR=$1
check() {  # binary, then flags its --help must list
  local bin=$BUILD_DIR/$1
  shift
  local out
  local help_rc=0
  out=$("$bin" --help 2>&1) || help_rc=$?
  [[ $help_rc -eq 0 ]] || { echo "$bin --help exited $help_rc (asking for help is no failure)"; exit 1; }
  if grep -q "No flags matched" <<<"$out"; then
    echo "$bin --help lists no flags:"; echo "$out"; exit 1
  fi
  for flag in "$@"; do
    grep -q -- "--$flag (" <<<"$out" || { echo "$bin --help does not list --$flag:"; echo "$out"; exit 1; }
  done
  grep -q "default: " <<<"$out" || { echo "$bin --help shows no defaults"; exit 1; }
  if grep -q "Flags from /" <<<"$out"; then echo "$bin --help shows build paths:"; echo "$out"; exit 1; fi
  if grep -q "Flags from .*absl/" <<<"$out"; then echo "$bin --help lists absl's own flags"; exit 1; fi
  local rc=0 err
  err=$("$bin" --no_such_flag 2>&1) || rc=$?
  [[ $rc -ne 0 ]] || { echo "$bin --no_such_flag exited 0"; exit 1; }
  grep -q "no_such_flag" <<<"$err" || { echo "$bin: unknown flag not named: $err"; exit 1; }
  # --version: the binary's name and the project's version, not absl's own.
  local ver
  ver=$("$bin" --version 2>&1)
  [[ $ver == "$(basename "$bin") $VERSION ("*" build)" ]] ||
    { echo "$bin --version: '$ver' (expected $(basename "$bin") $VERSION (... build))"; exit 1; }
}
VERSION=$(sed -n 's/^project(kvtier VERSION \([0-9.]*\).*/\1/p' "$(dirname "$0")/../CMakeLists.txt")
[[ -n $VERSION ]] || { echo "no version in CMakeLists.txt's project()"; exit 1; }
check services/store/kvtier-store data_dir listen ram_budget_mb metrics_listen
check services/worker/kvtier-worker store listen compute_threads max_working_set_mb
check services/controller/kvtier-controller listen replicas state_dir
check refengine/kvtier-engine worker store codec evict recall
ver=$("$BUILD_DIR/tools/kvtier" --version 2>&1)
[[ $ver == "kvtier $VERSION ("*" build)" ]] || { echo "kvtier --version: '$ver'"; exit 1; }
echo "cli_help_test: every binary's --help lists its flags; --version says $VERSION"
