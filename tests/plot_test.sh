#!/usr/bin/env bash
# kvtier plot over the tables in docs/ (the CSVs of kvtier eval codecs and
# eviction): each draws an SVG and a PNG with its series, and bad input gets
# a clear error. (demo_script_test plots a demo report.) Without gnuplot the
# test skips, except under CI=true.
set -euo pipefail
BUILD_DIR=$1
SRC_DIR=$(cd "$(dirname "$0")/.." && pwd)
K="$BUILD_DIR/tools/kvtier"
if ! command -v gnuplot >/dev/null 2>&1; then
  if [ "${CI:-}" = true ]; then echo "CI=true but gnuplot is missing"; exit 1; fi
  echo "skipping: no gnuplot (scripts/kvtier.sh deps installs gnuplot-nox)"
  exit 0
fi
OUT=$(mktemp -d /tmp/kvtier-plot-test-XXXXXX)
trap 'rm -rf "$OUT"' EXIT
"$K" plot codecs "$SRC_DIR/docs/codecs-fidelity.csv" --out="$OUT/c.svg" >/dev/null
grep -q "<svg" "$OUT/c.svg"
grep -q "kivi4:g=32" "$OUT/c.svg"
"$K" plot codecs "$SRC_DIR/docs/codecs-fidelity.csv" --y=kl --out="$OUT/c.png" >/dev/null
[ "$(head -c 4 "$OUT/c.png" | tail -c 3)" = PNG ]
"$K" plot eviction "$SRC_DIR/docs/eviction-table.csv" --out="$OUT/e.svg" >/dev/null
for m in streaming h2o snapkv pyramidkv ada-snapkv ada-pyramid; do grep -q ">$m<" "$OUT/e.svg"; done
# Errors name the problem.
if "$K" plot eviction "$SRC_DIR/docs/codecs-fidelity.csv" --out="$OUT/x.svg" 2>"$OUT/err"; then
  echo "a codecs table plotted as eviction"; exit 1
fi
grep -q "the CSV needs the columns method, budget_frac and kl" "$OUT/err"
if "$K" plot codecs "$SRC_DIR/docs/codecs-fidelity.csv" --out="$OUT/x.pdf" 2>"$OUT/err"; then
  echo "a .pdf was accepted"; exit 1
fi
grep -q "must end in .svg or .png" "$OUT/err"
echo "plot_test OK"
