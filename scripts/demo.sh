#!/usr/bin/env bash
# The demo behind `make demo`: kvtier serving multi-round chats end to end.
# It starts kvtier-store (RocksDB in a temp dir) and kvtier-worker on
# loopback, then kvtier-engine runs several concurrent conversations through
# the worker, layer by layer, beside an in-process full cache as the ground
# truth, and prints the report (docs/demo.md explains every line).
#
# Environment (defaults in brackets):
#   CODEC     codec of stored rounds: raw, fp16, kivi8, kivi4, kivi2, gear2, ...
#             [raw; kivi4 with MODEL=gemma3, the policy docs/fidelity.md recommends]
#   RECALL    all, topk:K, adaptive:LAMBDA, threshold:THETA, mass:P
#             [mass:0.95; all with MODEL=gemma3]
#   EVICT     none, METHOD:BUDGET, e.g. snapkv:64, ada-snapkv:32, or profile:FILE (an
#             EvolKV layer profile, e.g. docs/evolkv-gemma-c32.profile) [none]
#   MODEL     a GGUF file (llama or gemma3, docs/models.md) or a llama2.c checkpoint
#             (e.g. ../shared/models/stories260K.bin); "gemma3" installs Gemma 3 270M into
#             the cache (scripts/kvtier.sh model) and replays traces/gemma3_chats.jsonl
#             unless CONVERSATIONS says otherwise; unset or "synthetic" runs the
#             embedded synthetic multi-round chat [unset here; `make demo`: gemma3]
#   CONVERSATIONS  replay your own conversations instead: a JSON Lines file of token ids
#             of MODEL (docs/replay.md; defaults MODEL to ../shared/models/stories260K.bin),
#             e.g. traces/stories260k_chats.jsonl [unset]
#   COUNT     replay only the file's first COUNT conversations [all; 4 with MODEL=gemma3]
#   ANSWERS   with CONVERSATIONS: decode (one decode step per answer token) or prefill
#             (each round's answer as one prefill, every position scored from it: the
#             same figures several times faster, but no decode timings and no SPEC)
#             [decode]
#   TEACHER_CACHE  with CONVERSATIONS: a directory that keeps the full cache's logits
#             of each conversation (kvtier-engine --teacher_cache), so that replays of the
#             same conversations under other policies skip the full cache; about 1 MiB a
#             Gemma 3 answer token; yours to remove [unset]
#   MODE      remote: every layer's attention in kvtier-worker over gRPC; inproc: the
#             worker engine in kvtier-engine's own process, only the store remote (then
#             the same conversations run remote too, for the per-token cost) [remote]
#   SPEC      speculative token selection (InfiniGen, docs/speculation.md):
#             ALPHA[:BUDGET[:POOL_BYTES[:LOW_BYTES]]], e.g. 4, 4:64 or 4:0:65536 (POOL_BYTES
#             caps each session's host pool, trims stop at LOW_BYTES); defaults MODEL to
#             ../shared/models/stories260K.bin [unset]
#   SPEC_SKEW the model's skew file for SPEC; unset calibrates one first
#             (kvtier calibrate infinigen) [unset]
#   SESSIONS  concurrent conversations [4]
#   ROUNDS    rounds per conversation [24]
#   WATERSHED the watershed layer L_w [-1: 6 for the synthetic chat, L/3 for a model]
#   RAM_MB    kvtier-store RAM tier budget; older rounds spill to RocksDB [32]
#   REPORT    also write the report as JSON to this file [unset]
#   SHARED_DECODE_STREAM  true: every session's decode layers on one batched stream;
#             false: a stream per session and round [true]
#   PD        1: prefill on one kvtier-worker, decode on a second, each round handed off
#             layer by layer (docs/transfer.md) [0]
#   PREFILL_GPU, DECODE_GPU  with PD=1, the GPU each worker sees (CUDA_VISIBLE_DEVICES):
#             two GPUs make the hand-offs take the NCCL path, one GPU CUDA IPC [unset]
#   WORKER_ARGS  more flags for every kvtier-worker, e.g. "--placement=host" or
#             "--device_transfer=grpc" (kvtier-worker --help lists them) [unset]
#   LOGS      a directory to keep the store's and workers' logs in (they are
#             deleted with the demo's temporary directory otherwise) [unset]
#   TLS       1: every connection is mutual TLS, with certificates of a throwaway CA
#             (scripts/make_test_certs.sh): each server requires a client certificate
#             and each process presents its own (docs/security.md) [0]
set -euo pipefail
BUILD_DIR=${1:-build}
STORE_BIN="$BUILD_DIR/services/store/kvtier-store"
WORKER_BIN="$BUILD_DIR/services/worker/kvtier-worker"
ENGINE_BIN="$BUILD_DIR/refengine/kvtier-engine"
MODEL=${MODEL:-}
[ "$MODEL" = synthetic ] && MODEL=
CONVERSATIONS=${CONVERSATIONS:-}
COUNT=${COUNT:-}
if [ "$MODEL" = gemma3 ]; then
  # The policy docs/fidelity.md recommends on this model, unless set.
  CODEC=${CODEC:-kivi4}
  RECALL=${RECALL:-all}
  MODEL=$(scripts/kvtier.sh model)
  if [ -z "$CONVERSATIONS" ]; then
    CONVERSATIONS=traces/gemma3_chats.jsonl
    COUNT=${COUNT:-4}  # About 3 minutes on 2 cores; COUNT=20 replays them all.
  fi
fi
CODEC=${CODEC:-raw}
RECALL=${RECALL:-mass:0.95}
EVICT=${EVICT:-none}
if [ -n "$CONVERSATIONS" ]; then
  if [ ! -f "$CONVERSATIONS" ]; then
    echo "CONVERSATIONS=$CONVERSATIONS: no such file (JSON Lines of token ids, docs/replay.md)"
    exit 2
  fi
  CONVERSATIONS=$(realpath "$CONVERSATIONS")
  MODEL=${MODEL:-../shared/models/stories260K.bin}
fi
SPEC=${SPEC:-}
SPEC_SKEW=${SPEC_SKEW:-}
if [ -n "$SPEC" ]; then
  MODEL=${MODEL:-../shared/models/stories260K.bin}
  if [ -n "$SPEC_SKEW" ] && [ ! -f "$SPEC_SKEW" ]; then
    echo "SPEC_SKEW=$SPEC_SKEW: no such file (kvtier calibrate infinigen writes one)"
    exit 2
  fi
fi
SESSIONS=${SESSIONS:-4}
ROUNDS=${ROUNDS:-24}
WATERSHED=${WATERSHED:--1}
RAM_MB=${RAM_MB:-32}
REPORT=${REPORT:-}
WORK=$(mktemp -d /tmp/kvtier-demo-XXXXXX)
PIDS=()
NAMES=() LOGFILES=()  # Each of PIDS: the server, and its log in $WORK.
cleanup() {
  local rc=$? i status failed=0
  for i in "${!PIDS[@]}"; do
    kill "${PIDS[$i]}" 2>/dev/null || true
    status=0
    wait "${PIDS[$i]}" 2>/dev/null || status=$?
    # A server exits 0 on SIGTERM (143: killed before it took the signal, as
    # when the demo stops early); anything else is a failure to report.
    if [ "$status" != 0 ] && [ "$status" != 143 ]; then
      echo "kvtier demo: ${NAMES[$i]} exited with status $status while shutting down; its log ends:" >&2
      tail -n 3 "$WORK/${LOGFILES[$i]}" >&2 || true
      failed=1
    fi
  done
  if [ -n "${LOGS:-}" ]; then mkdir -p "$LOGS" && cp "$WORK"/*.log "$LOGS"/ 2>/dev/null || true; fi
  rm -rf "$WORK"
  if [ "$failed" = 1 ] && [ "$rc" = 0 ]; then exit 1; fi
}
trap cleanup EXIT
if [ -n "$CONVERSATIONS" ] && [ -n "$COUNT" ]; then
  head -n "$COUNT" "$CONVERSATIONS" >"$WORK/conversations.jsonl"
  CONVERSATIONS="$WORK/conversations.jsonl"
fi

STORE_TLS=() WORKER_TLS=() DECODE_TLS=() ENGINE_TLS=()
case "${TLS:-0}" in
  0) ;;
  1)
    T="$WORK/tls"
    "$(dirname "$0")/make_test_certs.sh" "$T" store worker decode engine
    STORE_TLS=(--tls_cert="$T/store.pem" --tls_key="$T/store.key" --tls_client_ca="$T/ca.pem")
    for w in worker decode; do
      declare -n tls="${w^^}_TLS"
      tls=(--tls_cert="$T/$w.pem" --tls_key="$T/$w.key" --tls_client_ca="$T/ca.pem"
        --store_tls_root_certs="$T/ca.pem" --peer_tls_root_certs="$T/ca.pem"
        --tls_client_cert="$T/$w.pem" --tls_client_key="$T/$w.key")
      unset -n tls
    done
    ENGINE_TLS=(--worker_tls_root_certs="$T/ca.pem" --store_tls_root_certs="$T/ca.pem"
      --tls_client_cert="$T/engine.pem" --tls_client_key="$T/engine.key")
    ;;
  *) echo "TLS=$TLS: 0 or 1"; exit 2 ;;
esac

wait_port() {  # file, log, name
  for _ in $(seq 300); do [ -s "$1" ] && return; sleep 0.05; done
  echo "$3 did not start:"; tail "$2"; exit 1
}
step() { printf '\n== %s\n' "$*"; }

if [ -n "$MODEL" ] && [ ! -f "$MODEL" ]; then
  echo "MODEL=$MODEL: no such file (a GGUF file, a llama2.c checkpoint such as ../shared/models/stories260K.bin, or gemma3)"
  exit 2
fi
if [ -n "$REPORT" ]; then REPORT=$(realpath -m "$REPORT"); fi

if [ -n "$SPEC" ] && [ -z "$SPEC_SKEW" ]; then
  step "Calibrating the InfiniGen skew of $MODEL (SPEC=$SPEC; SPEC_SKEW=file skips this)"
  "$BUILD_DIR/tools/kvtier" calibrate infinigen --model="$MODEL" --out="$WORK/model.skew"
  SPEC_SKEW="$WORK/model.skew"
fi

step "Starting kvtier-store (RocksDB in $WORK/db, RAM tier ${RAM_MB} MiB)"
"$STORE_BIN" --data_dir="$WORK/db" --listen=127.0.0.1:0 --port_file="$WORK/store.port" \
  --metrics_listen=127.0.0.1:0 --ram_budget_mb="$RAM_MB" "${STORE_TLS[@]}" 2>>"$WORK/store.log" &
PIDS+=($!) NAMES+=(kvtier-store) LOGFILES+=(store.log)
wait_port "$WORK/store.port" "$WORK/store.log" kvtier-store
STORE=127.0.0.1:$(cat "$WORK/store.port")
echo "kvtier-store on $STORE"

PREFILL_ENV=()
DECODE_ENV=()
read -r -a WORKER_EXTRA <<<"${WORKER_ARGS:-}"
if [ -n "${PREFILL_GPU:-}" ]; then PREFILL_ENV=(CUDA_VISIBLE_DEVICES="$PREFILL_GPU"); fi
if [ -n "${DECODE_GPU:-}" ]; then DECODE_ENV=(CUDA_VISIBLE_DEVICES="$DECODE_GPU"); fi

step "Starting kvtier-worker (rounds kept in that store)"
env "${PREFILL_ENV[@]}" "$WORKER_BIN" --store="$STORE" --listen=127.0.0.1:0 --port_file="$WORK/worker.port" \
  --metrics_listen=127.0.0.1:0 --metrics_port_file="$WORK/worker.mport" "${WORKER_EXTRA[@]}" \
  "${WORKER_TLS[@]}" 2>>"$WORK/worker.log" &
PIDS+=($!) NAMES+=(kvtier-worker) LOGFILES+=(worker.log)
wait_port "$WORK/worker.port" "$WORK/worker.log" kvtier-worker
WORKER=127.0.0.1:$(cat "$WORK/worker.port")
echo "kvtier-worker on $WORKER, metrics on 127.0.0.1:$(cat "$WORK/worker.mport")/metrics"

DECODE=""
if [ "${PD:-0}" = 1 ]; then
  step "Starting a second kvtier-worker that decodes (PD=1: prefill/decode disaggregation)"
  env "${DECODE_ENV[@]}" "$WORKER_BIN" --store="$STORE" --listen=127.0.0.1:0 --port_file="$WORK/decode.port" \
    --metrics_listen=127.0.0.1:0 --metrics_port_file="$WORK/decode.mport" "${WORKER_EXTRA[@]}" \
    "${DECODE_TLS[@]}" 2>>"$WORK/decode.log" &
  PIDS+=($!) NAMES+=("the decode kvtier-worker") LOGFILES+=(decode.log)
  wait_port "$WORK/decode.port" "$WORK/decode.log" kvtier-worker
  DECODE=127.0.0.1:$(cat "$WORK/decode.port")
  echo "decode kvtier-worker on $DECODE: each round is prefilled on $WORKER, handed off layer"
  echo "by layer while the prefill runs, decoded and ended on $DECODE, and handed back"
fi

if [ -n "$CONVERSATIONS" ]; then
  WHAT="the conversations of $CONVERSATIONS on $MODEL (local full cache vs kvtier, teacher-forced)"
  step "Replaying $(grep -c . "$CONVERSATIONS") conversations, $SESSIONS at a time: $WHAT"
elif [ -n "$MODEL" ]; then
  WHAT="the reference engine on $MODEL (local full cache vs kvtier, teacher-forced)"
else
  WHAT="the embedded synthetic multi-round chat (docs/demo.md)"
fi
if [ -z "$CONVERSATIONS" ]; then
  step "Serving $SESSIONS conversations x $ROUNDS rounds: $WHAT"
fi
echo "policy: CODEC=$CODEC RECALL=$RECALL EVICT=$EVICT${SPEC:+ SPEC=$SPEC}"
ARGS=(--worker="$WORKER" --store="$STORE" --sessions="$SESSIONS" --rounds="$ROUNDS"
  --codec="$CODEC" --recall="$RECALL" --evict="$EVICT" --watershed="$WATERSHED" "${ENGINE_TLS[@]}")
[ "${TLS:-0}" = 1 ] && echo "mutual TLS: store, workers and engine each present a certificate of $T/ca.pem"
[ -n "$MODEL" ] && ARGS+=(--model="$MODEL")
[ -n "$CONVERSATIONS" ] && ARGS+=(--conversations="$CONVERSATIONS")
case "${ANSWERS:-decode}" in
  decode) ;;
  prefill) ARGS+=(--answer_prefill) ;;
  *)
    echo "ANSWERS=$ANSWERS: expected decode or prefill"
    exit 2
    ;;
esac
[ -n "$REPORT" ] && ARGS+=(--report="$REPORT")
[ -n "${TEACHER_CACHE:-}" ] && ARGS+=(--teacher_cache="$(realpath -m "$TEACHER_CACHE")")
[ -n "$SPEC" ] && ARGS+=(--speculation="$SPEC" --skew="$SPEC_SKEW")
[ -n "${SHARED_DECODE_STREAM:-}" ] && ARGS+=(--shared_decode_stream="$SHARED_DECODE_STREAM")
MODE=${MODE:-remote}
if [ "$MODE" != remote ] && [ "$MODE" != inproc ]; then
  echo "MODE=$MODE: expected remote or inproc"
  exit 2
fi
if [ "$MODE" = inproc ]; then
  if [ -n "$DECODE" ]; then echo "MODE=inproc runs no worker: it cannot hand off (PD=1)"; exit 2; fi
  step "MODE=inproc: the worker engine inside kvtier-engine, its rounds in kvtier-store"
  INPROC_ARGS=()
  for a in "${ARGS[@]}"; do [[ $a == --worker=* ]] || INPROC_ARGS+=("$a"); done
  "$ENGINE_BIN" "${INPROC_ARGS[@]}" --inproc | tee "$WORK/inproc.txt"
  step "The same conversations through kvtier-worker (MODE=remote, the baseline)"
  "$ENGINE_BIN" "${ARGS[@]}" --report= --quiet >"$WORK/remote.txt"
  echo "decode, worker engine in process: $(grep -o '^decode: [0-9.]* ms per token' "$WORK/inproc.txt" | grep -o '[0-9.]* ms')"
  echo "decode, through kvtier-worker:     $(grep -o '^decode: [0-9.]* ms per token' "$WORK/remote.txt" | grep -o '[0-9.]* ms')"
elif [ -n "$DECODE" ]; then
  "$ENGINE_BIN" "${ARGS[@]}" --decode_worker="$DECODE" | tee "$WORK/pd.txt"
  step "The same conversations on one worker, no hand-off (the baseline for time to first token)"
  "$ENGINE_BIN" "${ARGS[@]}" --report= >"$WORK/single.txt"
  echo "time to first token, disaggregated: $(grep -o 'prefill (time to first token[^:]*: [0-9.]* ms' "$WORK/pd.txt" | grep -o '[0-9.]* ms$')"
  echo "time to first token, one worker:    $(grep -o 'prefill (time to first token[^:]*: [0-9.]* ms' "$WORK/single.txt" | grep -o '[0-9.]* ms$')"
  # The synthetic chat digests every attention output: prefill on one worker
  # and decode on another must return exactly what one worker does.
  PD_DIGEST=$(grep -o '^outputs digest: [0-9a-f]*' "$WORK/pd.txt" | grep -o '[0-9a-f]*$' || true)
  ONE_DIGEST=$(grep -o '^outputs digest: [0-9a-f]*' "$WORK/single.txt" | grep -o '[0-9a-f]*$' || true)
  if [ -n "$PD_DIGEST" ] && [ "$PD_DIGEST" = "$ONE_DIGEST" ]; then
    echo "outputs, disaggregated: bit-identical to one worker's (digest $PD_DIGEST)"
  elif [ -n "$PD_DIGEST" ]; then
    echo "outputs, disaggregated: DIFFER from one worker's (digest $PD_DIGEST, one worker $ONE_DIGEST)"
    OUTPUTS_DIFFER=1
  fi
else
  "$ENGINE_BIN" "${ARGS[@]}"
fi

if command -v curl >/dev/null 2>&1; then
  step "kvtier-worker's Prometheus counters"
  curl -s "127.0.0.1:$(cat "$WORK/worker.mport")/metrics" |
    grep -E '^kvtier_worker_(recalls|recall_rounds|bytes_fetched|bytes_stored|transfer|speculation|device_(call|blocks|cached))' || true
  if [ -n "$DECODE" ]; then
    step "The decode kvtier-worker's Prometheus counters"
    curl -s "127.0.0.1:$(cat "$WORK/decode.mport")/metrics" |
      grep -E '^kvtier_worker_(transfer|device_(call|blocks|cached))' || true
  fi
fi
echo
echo "Try: CODEC=kivi2 make demo, RECALL=mass:0.95 make demo, EVICT=snapkv:32 make demo,"
echo "     MODEL=synthetic make demo (the embedded synthetic chat), REPORT=report.json make demo,"
echo "     MODEL=../shared/models/stories260K.bin make demo, COUNT=20 make demo (Gemma, all 20),"
echo "     PD=1 make demo (prefill and decode on two workers),"
echo "     CONVERSATIONS=traces/stories260k_chats.jsonl make demo (replay conversations),"
echo "     SPEC=4 make demo (InfiniGen speculation on stories260K),"
echo "     MODE=inproc make demo (the worker engine in the engine's process)"
if [ "${OUTPUTS_DIFFER:-0}" = 1 ]; then
  echo "kvtier demo: the disaggregated run's outputs differ from one worker's (see above)" >&2
  exit 1
fi
