#!/usr/bin/env bash
# Builds the kvtier image (deploy/container/Containerfile) with podman or
# docker, then runs `make demo`'s servers inside it: kvtier-store and
# kvtier-worker in one container, kvtier-engine against them. Where no
# container engine works on this machine, it says so and exits 0.
#   deploy/container/build.sh [TAG]      (default kvtier:0.1.0)
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${1:-kvtier:0.1.0}
ENGINE=""
for e in podman docker; do
  if command -v "$e" >/dev/null 2>&1 && timeout 20 "$e" info >/dev/null 2>&1; then
    ENGINE=$e
    break
  fi
done
if [ -z "$ENGINE" ]; then
  echo "build.sh: no working container engine here (podman or docker with a running daemon);"
  echo "the image was not built. deploy/k8s is checked offline by tests/k8s_test.sh."
  exit 0
fi
echo "== building $TAG with $ENGINE"
"$ENGINE" build -f deploy/container/Containerfile -t "$TAG" .
echo "== the demo inside $TAG"
"$ENGINE" run --rm "$TAG" bash -c '
  set -e
  kvtier-store --data_dir=/var/lib/kvtier/db --listen=127.0.0.1:7070 --metrics_listen= &
  sleep 1
  kvtier-worker --store=127.0.0.1:7070 --listen=127.0.0.1:7071 --metrics_listen= &
  sleep 1
  kvtier-engine --worker=127.0.0.1:7071 --store=127.0.0.1:7070 --sessions=2 --rounds=6'
