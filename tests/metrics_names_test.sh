#!/usr/bin/env bash
# Every kvtier metric the Grafana dashboard and the Prometheus alert rules
# name (deploy/grafana, deploy/prometheus) is one the servers export: a
# metric family registered in services/ (histograms add _bucket, _sum and
# _count). The dashboard is valid JSON and every alert rule has an expr.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
fail() { echo "metrics_names_test: $*"; exit 1; }
exported=$(grep -rhoE '"kvtier_[a-z_]+"' "$SRC/services" --include='*.cc' --include='*.h' | tr -d '"' | sort -u)
[[ -n $exported ]] || fail "found no metric names under services/"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["panels"]' \
  "$SRC/deploy/grafana/kvtier-dashboard.json" || fail "dashboard is not valid JSON"
n_rules=$(grep -c '^      - alert:' "$SRC/deploy/prometheus/kvtier-alerts.yml")
n_exprs=$(grep -c '^        expr:' "$SRC/deploy/prometheus/kvtier-alerts.yml")
[[ $n_rules -gt 0 && $n_rules -eq $n_exprs ]] || fail "$n_rules alerts but $n_exprs exprs"
named=$(cat "$SRC/deploy/grafana/kvtier-dashboard.json" "$SRC/deploy/prometheus/kvtier-alerts.yml" |
  grep -oE 'kvtier_[a-z_]+' | sort -u)
count=0
for m in $named; do
  base=$(sed -E 's/_(bucket|sum|count)$//' <<<"$m")
  grep -qx "$m" <<<"$exported" || grep -qx "$base" <<<"$exported" ||
    fail "$m is named in deploy/ but no server exports it"
  count=$((count + 1))
done
echo "metrics_names_test: $count metrics named in the dashboard and alerts, all exported"
