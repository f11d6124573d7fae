#!/usr/bin/env bash
# Keeps the arrows pointing one way (ARCHITECTURE.md §4): each folder may
# include, and link, only the folders below it, and the engines (kernels/,
# cachestore/, worker/, ...) neither include nor link gRPC. Prints every
# violation and exits 1 when there is one.
#   scripts/check_layering.sh [SOURCE_DIR] [--links]
# Includes: every `#include "..."` and every `#include <...>` whose first
# component is a project folder or a library this table knows (absl, grpcpp,
# google, rocksdb, ...); the C++ and system headers are not checked.
# --links: also the CMake link graph. SOURCE_DIR is configured into a
# temporary build folder with `cmake --graphviz` (CUDA as the environment's
# KVTIER_CUDA says, default OFF: the link rules do not depend on it), and
# every direct link edge of a target declared in a folder is checked as its
# includes are: a target belongs to the folder whose CMakeLists.txt declares
# it; kvtier_proto is "kvtier" (the generated headers), kvtier_proto_grpc and
# gRPC::* are "grpcpp", protobuf::* is "google", absl::* is "absl".
set -euo pipefail
SRC=.
LINKS=0
for a in "$@"; do
  case "$a" in
    --links) LINKS=1 ;;
    *) SRC=$a ;;
  esac
done
cd "$SRC"

# folder -> the first path components its non-test files may include (and its
# targets may link).
declare -A ALLOW=(
  [base]="absl base"
  [kernels]="absl base kernels"
  [encoded]="absl base kernels encoded kvtier google"
  [cachestore]="absl base kernels encoded cachestore kvtier google rocksdb"
  [worker]="absl base kernels encoded worker kvtier google"
  [controller]="absl base controller"
  [model]="absl base kernels model"
  [traces]="absl base kernels encoded model traces kvtier google"
  [eval]="absl base kernels encoded model traces eval kvtier google"
  [rpc]="absl base kernels encoded worker rpc kvtier google grpc grpcpp"
  [client]="absl base kernels encoded worker rpc client kvtier google grpcpp"
  [services]="absl base kernels encoded cachestore worker controller rpc client services kvtier google grpcpp prometheus CivetServer.h civetweb.h"
  [refengine]="absl base kernels encoded model traces worker rpc client refengine kvtier google grpcpp"
  [tools]="absl base kernels encoded model traces eval worker rpc client refengine tools kvtier google grpcpp"
  [bench]="bench absl base kernels encoded cachestore rpc client worker controller services testing kvtier google grpcpp benchmark"
  [testing]="absl base kernels encoded testing kvtier google"
  [fuzz]="absl base kernels encoded model worker rpc services refengine fuzz testing kvtier google grpcpp"
)
# Folders whose code must not see gRPC (services are thin; engines are not).
NO_GRPC="base kernels encoded cachestore worker controller model traces eval testing"
# Targets that must not reach another through any chain of links, with why.
DENY=(
  "kvtier_client kvtier_worker the client SDK ships without the worker engine (and CUDA)"
  "kvtier_kernels kvtier_proto the kernels know no protobuf (encoded/ frames their buffers)"
  "kvtier_kernels protobuf::libprotobuf the kernels know no protobuf (encoded/ frames their buffers)"
)
# `#include <X/...>` is checked when X is one of these (or a folder above).
KNOWN_LIBS="absl google grpc grpcpp kvtier rocksdb prometheus benchmark gtest gmock"

bad=0
for dir in "${!ALLOW[@]}"; do
  [ -d "$dir" ] || continue
  allowed=" ${ALLOW[$dir]} "
  while IFS= read -r hit; do
    file=${hit%%:*}
    rest=${hit#*:}
    line=${rest%%:*}
    inc=$(sed -E 's/.*#include ["<]([^">]+)[">].*/\1/' <<<"$rest")
    top=${inc%%/*}
    if [[ "$rest" == *"#include <"* ]]; then
      # Standard and system headers (<vector>, <sys/mman.h>) are not ours.
      [[ "$inc" == */* && " $KNOWN_LIBS ${!ALLOW[*]} " == *" $top "* ]] || continue
    fi
    case "$file" in
      *_test.cc | */cuda/*_test.cc) allowed_here="$allowed gtest gmock tests testing " ;;
      *) allowed_here=$allowed ;;
    esac
    if [[ "$allowed_here" != *" $top "* ]]; then
      echo "$file:$line: $dir/ may not include \"$inc\" (allowed: ${ALLOW[$dir]})"
      bad=1
    fi
    if [[ " $NO_GRPC " == *" $dir "* && ("$inc" == *.grpc.pb.h || "$top" == grpcpp) ]]; then
      echo "$file:$line: $dir/ is below the gRPC edge and may not include \"$inc\""
      bad=1
    fi
  done < <(grep -rnE '^#include ["<]' "$dir" --include='*.h' --include='*.cc' --include='*.cu' || true)
done

links=""
if ((LINKS)); then
  command -v cmake >/dev/null || { echo "check_layering: --links needs cmake" >&2; exit 2; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/build"
  printf 'set(GRAPHVIZ_GENERATE_PER_TARGET FALSE)\nset(GRAPHVIZ_GENERATE_DEPENDERS FALSE)\n' \
    >"$tmp/build/CMakeGraphVizOptions.cmake"
  if ! cmake -S . -B "$tmp/build" -DKVTIER_CUDA="${KVTIER_CUDA:-OFF}" \
    --graphviz="$tmp/graph/links.dot" >"$tmp/configure.log" 2>&1; then
    cat "$tmp/configure.log" >&2
    echo "check_layering: cmake could not configure $(pwd) for the link graph" >&2
    exit 2
  fi
  # target -> folder, from the CMakeLists.txt that declares it (test
  # executables, declared by kvtier_test, are checked by their includes).
  # An edge to an executable is a build-order dependency (a test helper
  # that starts kvtier-store), not a link.
  declare -A FOLDER=() PROGRAM=()
  while IFS= read -r hit; do
    f=${hit%%/*}
    name=$(sed -E 's/.*add_(library|executable)\(([A-Za-z0-9_.+-]+).*/\2/' <<<"${hit#*:}")
    FOLDER[$name]=$f
    [[ "$hit" == *add_executable* ]] && PROGRAM[$name]=1
  done < <(grep -rE '^\s*add_(library|executable)\(' --include=CMakeLists.txt . |
    sed -E 's#^\./##' | grep -v '^build' || true)
  # A linked name -> the component its edge is checked as ("" = not checked).
  component() {
    case "$1" in
      kvtier_proto) echo kvtier ;;
      kvtier_proto_grpc | gRPC::*) echo grpcpp ;;
      protobuf::*) echo google ;;
      absl::*) echo absl ;;
      *rocksdb*) echo rocksdb ;;
      prometheus-cpp::*) echo prometheus ;;
      *) if [ -n "${FOLDER[$1]:-}" ]; then echo "${FOLDER[$1]}"; fi ;;
    esac
  }
  declare -A LABEL=()
  while IFS=$'\t' read -r id label; do LABEL[$id]=$label; done < <(
    sed -nE 's/^\s*"(node[0-9]+)" \[ label = "([^"]+)".*/\1\t\2/p' "$tmp/graph/links.dot")
  n=0
  while IFS=$'\t' read -r from to; do
    src=${LABEL[$from]:-}
    dst=${LABEL[$to]:-}
    dir=${FOLDER[$src]:-}
    [ -n "$dir" ] && [ -n "${ALLOW[$dir]:-}" ] && [ -z "${PROGRAM[$dst]:-}" ] || continue
    comp=$(component "$dst")
    [ -n "$comp" ] || continue
    n=$((n + 1))
    if [[ " ${ALLOW[$dir]} " != *" $comp "* ]]; then
      echo "link: $src ($dir/) may not link $dst ($comp; allowed: ${ALLOW[$dir]})"
      bad=1
    elif [[ " $NO_GRPC " == *" $dir "* && "$comp" == grpcpp ]]; then
      echo "link: $src ($dir/) is below the gRPC edge and may not link $dst"
      bad=1
    fi
  done < <(sed -nE 's/^\s*"(node[0-9]+)" -> "(node[0-9]+)".*/\1\t\2/p' "$tmp/graph/links.dot")
  # Transitive: what each denied pair's first target reaches.
  declare -A OUT=()
  while IFS=$'\t' read -r from to; do OUT[${LABEL[$from]:-?}]+=" ${LABEL[$to]:-?}"; done < <(
    sed -nE 's/^\s*"(node[0-9]+)" -> "(node[0-9]+)".*/\1\t\2/p' "$tmp/graph/links.dot")
  for rule in "${DENY[@]}"; do
    read -r from to why <<<"$rule"
    declare -A seen=()
    queue=("$from")
    while ((${#queue[@]})); do
      t=${queue[0]}
      queue=("${queue[@]:1}")
      for next in ${OUT[$t]:-}; do
        [ -z "${seen[$next]:-}" ] || continue
        seen[$next]=1
        queue+=("$next")
      done
    done
    if [ -n "${seen[$to]:-}" ]; then
      echo "link: $from reaches $to through its links: $why"
      bad=1
    fi
    unset seen
  done
  links=", $n link edges, ${#DENY[@]} denied reaches"
fi

if ((bad)); then
  echo "check_layering: violations above (see ARCHITECTURE.md §4 and scripts/check_layering.sh)"
  exit 1
fi
echo "check_layering: OK (${#ALLOW[@]} folders$links)"
