#!/usr/bin/env bash
# `kvtier policy` against a real kvtier-controller, as an operator uses it:
# --codec takes the settings the demo and the Python client take (kivi4,
# gear2:r=2) as well as a family with --bits; --recall takes mass:P; the
# eviction names are the demo's (streamingllm and ada-pyramid accepted too);
# `get` prints one line in those names with every default filled in
# (--format=proto: the answer as protobuf text); a bad value is exit 2 with
# one line naming the flag, and nothing is registered.
set -euo pipefail
BUILD_DIR=$1
CTL=$BUILD_DIR/services/controller/kvtier-controller
KV=$BUILD_DIR/tools/kvtier
W=$(mktemp -d /tmp/kvtier-policy-cli-XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
fail() { echo "policy_cli_test: $*"; exit 1; }
wait_file() { for _ in $(seq 100); do [[ -s $1 ]] && return 0; sleep 0.1; done; fail "no $1"; }

"$CTL" --listen=127.0.0.1:0 --port_file="$W/port" --metrics_listen= >"$W/ctl.log" 2>&1 &
PIDS+=($!)
wait_file "$W/port"  # A port file the child writes once: not a synchronization sleep.
export KVTIER_CONTROLLER=127.0.0.1:$(cat "$W/port")

expect_line() {  # MODEL TEXT: `policy get` of MODEL contains TEXT.
  "$KV" policy get --model="$1" >"$W/get.out" || { cat "$W/get.out"; fail "get $1 failed"; }
  grep -qF -- "$2" "$W/get.out" || { cat "$W/get.out"; fail "get $1: no '$2'"; }
}
expect_refused() {  # FLAG TEXT ARGS...: exit 2, one line naming the flag and TEXT.
  local flag=$1 text=$2
  shift 2
  local rc=0
  "$KV" policy set --model=refused "$@" >"$W/err.out" 2>&1 || rc=$?
  [[ $rc -eq 2 ]] || { cat "$W/err.out"; fail "$* exited $rc, not 2"; }
  [[ $(wc -l <"$W/err.out") -eq 1 ]] || { cat "$W/err.out"; fail "$*: more than one line"; }
  grep -qF -- "$flag" "$W/err.out" || { cat "$W/err.out"; fail "$*: does not name $flag"; }
  grep -qF -- "$text" "$W/err.out" || { cat "$W/err.out"; fail "$*: no '$text'"; }
}

"$KV" policy set --model=a --codec=kivi4 --recall=mass:0.95 --eviction=snapkv --budget_tokens=64 \
  >/dev/null
expect_line a "codec=kivi4:g=32 recall=mass:0.95 eviction=snapkv:64"
expect_line a "pressure: none"
"$KV" policy set --model=b --codec=kivi --bits=2 --eviction=streamingllm --budget_tokens=64 >/dev/null
expect_line b "codec=kivi2:g=32"
expect_line b "eviction=streaming:64"
"$KV" policy set --model=c --codec=gear2:r=2 --eviction=ada-pyramidkv --budget_tokens=32 >/dev/null
expect_line c "codec=gear2:g=32:r=2"
expect_line c "eviction=ada-pyramid:32"
"$KV" policy set --model=d --codec=fp16 --bits=8 >/dev/null  # --bits overrides a setting's.
"$KV" policy get --model=c --format=proto >"$W/proto.out"
grep -q "codec: CODEC_GEAR" "$W/proto.out" || { cat "$W/proto.out"; fail "--format=proto"; }

expect_refused --codec "codec 'kivi9x' needs bits" --codec=kivi9x
expect_refused --codec "unknown codec 'bogus'" --codec=bogus
expect_refused --recall "mass must be in (0, 1]" --recall=mass:2
expect_refused --eviction "unknown eviction method 'snapk'" --eviction=snapk --budget_tokens=8
expect_refused --eviction "needs --budget_tokens" --eviction=snapkv
expect_refused --profile "--profile=FILE" --eviction=profile:x.txt
rc=0
"$KV" policy get --model=a --format=yaml >"$W/err.out" 2>&1 || rc=$?
[[ $rc -eq 2 ]] && grep -q -- "--format" "$W/err.out" || { cat "$W/err.out"; fail "--format=yaml"; }
if "$KV" policy get --model=refused >"$W/none.out" 2>&1; then
  cat "$W/none.out"; fail "a refused set registered a policy"
fi
echo "policy_cli_test: ok"
