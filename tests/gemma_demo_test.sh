#!/usr/bin/env bash
# `make demo` on Gemma 3 270M, one conversation of traces/gemma3_chats.jsonl
# (the shortest: 499 tokens, 4 questions about earlier rounds), every round
# recalled and stored losslessly: through kvtier-worker and with the worker
# engine in process, the tier answers as kvtier's own full cache (top-1 1.000,
# KL 0.0000) and the report prints the questions and answers as text. Needs
# the model (KVTIER_GEMMA, exported by `scripts/kvtier.sh test`); skipped
# (exit 77) without it.
set -euo pipefail
BUILD_DIR=$1
SRC_DIR=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KVTIER_GEMMA:-}" ]; then
  echo "skipped: run through 'make test', or set KVTIER_GEMMA=\$(scripts/kvtier.sh model)"
  exit 77
fi
OUT=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gemma-demo-XXXXXX")
trap 'rm -rf "$OUT"' EXIT
sed -n 6p "$SRC_DIR/traces/gemma3_chats.jsonl" >"$OUT/one.jsonl"
grep -q '"id": "gemma3-chat-05"' "$OUT/one.jsonl"
for mode in remote inproc; do
  MODEL="$KVTIER_GEMMA" CONVERSATIONS="$OUT/one.jsonl" RECALL=all SESSIONS=1 MODE=$mode \
    "$SRC_DIR/scripts/demo.sh" "$BUILD_DIR" >"$OUT/$mode.txt" 2>&1 || {
    cat "$OUT/$mode.txt"
    exit 1
  }
  for want in "replayed from" "18 layers" \
    "top-1 agreement 1.000, KL 0.0000 nats" \
    "accuracy on the scored spans (15 tokens): kvtier 1.000, full cache 1.000" \
    "questions about earlier rounds (4): kvtier right 4, full cache right 4" \
    "round 9: User: What instrument does my brother Tom play?" \
    'kvtier (right)    " violin."'; do
    grep -qF "$want" "$OUT/$mode.txt" || {
      echo "MODE=$mode: the report lacks: $want"
      cat "$OUT/$mode.txt"
      exit 1
    }
  done
done
grep -q "the worker engine inside kvtier-engine" "$OUT/inproc.txt"
echo "gemma demo: remote and in-process match the full cache; answers printed"
