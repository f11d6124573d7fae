#!/usr/bin/env bash
# scripts/check_layering.sh against small source trees made here: a tree
# whose arrows point down passes, and each kind of upward arrow (a quoted
# include, an angle include, a direct link, a denied reach through other
# targets) fails naming the arrow.
#   tests/check_layering_test.sh SOURCE_DIR
set -euo pipefail
CHECK="$(realpath "${1:-$(dirname "$0")/..}")/scripts/check_layering.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# A tree with base/, kernels/, worker/ and client/ as the project has them:
# INTERFACE libraries, so that it configures without a compiler.
make_tree() {
  local d=$1
  rm -rf "$d"
  mkdir -p "$d"/{base,kernels,worker,client}
  cat >"$d/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.16)
project(layering_fixture NONE)
add_subdirectory(base)
add_subdirectory(kernels)
add_subdirectory(worker)
add_subdirectory(client)
EOF
  echo 'add_library(kvtier_base INTERFACE)' >"$d/base/CMakeLists.txt"
  printf 'add_library(kvtier_kernels INTERFACE)\ntarget_link_libraries(kvtier_kernels INTERFACE kvtier_base)\n' \
    >"$d/kernels/CMakeLists.txt"
  printf 'add_library(kvtier_worker INTERFACE)\ntarget_link_libraries(kvtier_worker INTERFACE kvtier_kernels)\n' \
    >"$d/worker/CMakeLists.txt"
  printf 'add_library(kvtier_client INTERFACE)\ntarget_link_libraries(kvtier_client INTERFACE kvtier_kernels)\n' \
    >"$d/client/CMakeLists.txt"
  printf '#include <vector>\n#include <sys/mman.h>\n#include "absl/status/status.h"\n#include "base/x.h"\n' \
    >"$d/kernels/codec.h"
}

fails=0
# expect NAME RC PATTERN: the check on $tmp/t exits RC and prints PATTERN.
expect() {
  local name=$1 want=$2 pattern=$3 rc=0
  "$CHECK" "$tmp/t" --links >"$tmp/out" 2>&1 || rc=$?
  if [ "$rc" != "$want" ] || ! grep -qF -- "$pattern" "$tmp/out"; then
    echo "FAIL $name: exit $rc (want $want), output:"
    sed 's/^/  /' "$tmp/out"
    fails=$((fails + 1))
  else
    echo "ok   $name"
  fi
}

make_tree "$tmp/t"
expect "arrows down" 0 "check_layering: OK"

make_tree "$tmp/t"
echo 'target_link_libraries(kvtier_kernels INTERFACE kvtier_worker)' >>"$tmp/t/kernels/CMakeLists.txt"
expect "kernels links worker" 1 "link: kvtier_kernels (kernels/) may not link kvtier_worker"

make_tree "$tmp/t"
printf 'add_library(kvtier_helper INTERFACE)\ntarget_link_libraries(kvtier_helper INTERFACE kvtier_worker)\n' \
  >>"$tmp/t/worker/CMakeLists.txt"
echo 'target_link_libraries(kvtier_client INTERFACE kvtier_helper)' >>"$tmp/t/client/CMakeLists.txt"
expect "client reaches worker" 1 "link: kvtier_client reaches kvtier_worker through its links"

make_tree "$tmp/t"
echo 'target_link_libraries(kvtier_kernels INTERFACE protobuf::libprotobuf)' >>"$tmp/t/kernels/CMakeLists.txt"
expect "kernels links protobuf" 1 "link: kvtier_kernels (kernels/) may not link protobuf::libprotobuf"

make_tree "$tmp/t"
echo '#include "kvtier/v1/tensor.pb.h"' >>"$tmp/t/kernels/codec.h"
expect "kernels include a proto" 1 'kernels/ may not include "kvtier/v1/tensor.pb.h"'

make_tree "$tmp/t"
echo '#include "worker/engine.h"' >>"$tmp/t/kernels/codec.h"
expect "quoted include upward" 1 'kernels/ may not include "worker/engine.h"'

make_tree "$tmp/t"
echo '#include <grpcpp/grpcpp.h>' >>"$tmp/t/worker/engine.h"
expect "angle include of gRPC" 1 'worker/ may not include "grpcpp/grpcpp.h"'

if ((fails)); then
  echo "check_layering_test: $fails case(s) failed"
  exit 1
fi
echo "check_layering_test: OK"
