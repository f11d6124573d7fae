#!/usr/bin/env bash
# Keeps the include arrows pointing one way (ARCHITECTURE.md §4): each folder
# may include only the folders below it, and the engines (kernels/,
# cachestore/, worker/, ...) include no gRPC at all. Prints every violation
# as FILE:LINE: and exits 1 when there is one.
#   scripts/check_layering.sh [SOURCE_DIR]
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"

# folder -> the first path components its non-test files may include.
declare -A ALLOW=(
  [base]="absl base"
  [kernels]="absl base kernels kvtier google"
  [cachestore]="absl base kernels cachestore kvtier google rocksdb"
  [worker]="absl base kernels worker kvtier google"
  [controller]="absl base controller"
  [model]="absl base kernels model"
  [traces]="absl base kernels model traces kvtier google"
  [eval]="absl base kernels model traces eval kvtier google"
  [rpc]="absl base kernels rpc kvtier google grpc grpcpp"
  [client]="absl base kernels worker rpc client kvtier google grpcpp"
  [services]="absl base kernels cachestore worker controller rpc client services kvtier google grpcpp prometheus CivetServer.h civetweb.h"
  [refengine]="absl base kernels model traces worker rpc client refengine kvtier google grpcpp"
  [tools]="absl base kernels model traces eval worker rpc client refengine tools kvtier google grpcpp"
  [bench]="bench absl base kernels cachestore rpc client worker controller services testing kvtier google grpcpp benchmark"
  [testing]="absl base kernels testing kvtier google"
  [fuzz]="absl base kernels model worker rpc services refengine fuzz testing kvtier google grpcpp"
)
# Folders whose code must not see gRPC (services are thin; engines are not).
NO_GRPC="base kernels cachestore worker controller model traces eval testing"

bad=0
for dir in "${!ALLOW[@]}"; do
  [ -d "$dir" ] || continue
  allowed=" ${ALLOW[$dir]} "
  while IFS= read -r hit; do
    file=${hit%%:*}
    rest=${hit#*:}
    line=${rest%%:*}
    inc=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<<"$rest")
    top=${inc%%/*}
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
  done < <(grep -rnE '^#include "' "$dir" --include='*.h' --include='*.cc' --include='*.cu' || true)
done
if ((bad)); then
  echo "check_layering: violations above (see ARCHITECTURE.md §4 and scripts/check_layering.sh)"
  exit 1
fi
echo "check_layering: OK (${#ALLOW[@]} folders)"
