#!/usr/bin/env bash
# deploy/k8s rendered offline: `kubectl kustomize` renders every overlay and
# deploy/k8s/check.py finds their objects in agreement (selectors, labels,
# ports, probes, addresses, and every container flag known to its binary's
# --help). Then the check is shown to catch a broken render. No cluster is
# needed; without kubectl the test skips, except under CI=true.
set -euo pipefail
BUILD_DIR=$1
SRC_DIR=$(cd "$(dirname "$0")/.." && pwd)
if ! command -v kubectl >/dev/null 2>&1; then
  if [ "${CI:-}" = true ]; then echo "CI=true but kubectl is missing"; exit 1; fi
  echo "skipping: no kubectl (scripts/kvtier.sh deps installs Debian's kubernetes-client)"
  exit 0
fi
OUT=$(mktemp -d /tmp/kvtier-k8s-XXXXXX)
trap 'rm -rf "$OUT"' EXIT
for b in store/kvtier-store worker/kvtier-worker controller/kvtier-controller; do
  "$BUILD_DIR/services/$b" --help >"$OUT/$(basename $b).help" 2>&1 || true
done
etcd --help >"$OUT/etcd.help" 2>&1 || true
overlays=0
for dir in "$SRC_DIR"/deploy/k8s/overlays/*/; do
  name=$(basename "$dir")
  kubectl kustomize "$dir" >"$OUT/$name.yaml" 2>"$OUT/$name.err" ||
    { cat "$OUT/$name.err"; echo "kubectl kustomize $name failed"; exit 1; }
  /usr/bin/python3 "$SRC_DIR/deploy/k8s/check.py" --help_dir="$OUT" --name="$name" <"$OUT/$name.yaml"
  overlays=$((overlays + 1))
done
[ "$overlays" -ge 4 ] || { echo "expected 4 overlays, found $overlays"; exit 1; }
# The mesh keeps a conversation on its worker by the session header the
# clients send.
grep -q "httpHeaderName: x-kvtier-session" "$OUT/mesh.yaml"
# A broken render fails, and says where.
sed -e 's/targetPort: grpc/targetPort: grcp/' -e 's/--store=kvtier-store-0/--stor=kvtier-store-0/' \
  "$OUT/single-node.yaml" >"$OUT/broken.yaml"
if /usr/bin/python3 "$SRC_DIR/deploy/k8s/check.py" --help_dir="$OUT" --name=broken \
  <"$OUT/broken.yaml" >"$OUT/broken.txt"; then
  cat "$OUT/broken.txt"; echo "the check passed a broken render"; exit 1
fi
grep -q "Service/kvtier-store: targetPort grcp is not a port of StatefulSet/kvtier-store" "$OUT/broken.txt"
grep -q "Deployment/kvtier-worker: /usr/local/bin/kvtier-worker has no flag --stor" "$OUT/broken.txt"
echo "k8s_test: $overlays overlays render and agree"
