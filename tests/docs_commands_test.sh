#!/usr/bin/env bash
# The commands the docs show still parse: every --flag written on a line that
# runs kvtier-store, -worker, -controller or -engine is one that binary's
# --help lists; every --flag on a line running `kvtier SUB` is one that
# `kvtier SUB --help` (or the tool's help) names; every `make TARGET` in
# backticks is a target of the Makefile.
set -euo pipefail
BUILD_DIR=$1
SRC=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d /tmp/kvtier-docs-XXXXXX)
trap '[[ -n ${KEEP:-} ]] || rm -rf "$TMP"' EXIT
declare -A BIN=([kvtier-store]=services/store/kvtier-store
  [kvtier-worker]=services/worker/kvtier-worker
  [kvtier-controller]=services/controller/kvtier-controller
  [kvtier-engine]=refengine/kvtier-engine)
for b in "${!BIN[@]}"; do "$BUILD_DIR/${BIN[$b]}" --help >"$TMP/$b.help" 2>&1 || true; done
for sub in store eval budgets policy calibrate conversations; do
  "$BUILD_DIR/tools/kvtier" "$sub" --help >"$TMP/tool-$sub.help" 2>&1 || true
  "$BUILD_DIR/tools/kvtier" "$sub" help >>"$TMP/tool-$sub.help" 2>&1 || true
done
for ev in eviction watershed speculation; do
  "$BUILD_DIR/tools/kvtier" eval "$ev" --help >>"$TMP/tool-eval.help" 2>&1 || true
done
"$BUILD_DIR/tools/kvtier" --help >"$TMP/kvtier.help" 2>&1 || true
bad=0 checked=0
docs=("$SRC/README.md" "$SRC"/docs/*.md "$SRC/deploy/README.md")
for doc in "${docs[@]}"; do
  rel=${doc#"$SRC"/}
  n=0
  cont=""
  while IFS= read -r line; do
    n=$((n + 1))
    flags=$(grep -oE -- '--[a-z][a-z0-9_]+' <<<"$line" | sed 's/^--//' | sort -u || true)
    if [[ -z $flags ]]; then
      cont=""
      continue
    fi
    helps=()
    # A line that runs a binary: its name followed by flags or "...".
    for b in "${!BIN[@]}"; do
      grep -qE "(^|[ /\`])$b +(\[?--|\.\.\.)" <<<"$line" && helps+=("$TMP/$b.help")
    done
    # A synopsis continued on the next lines ("[--flag] ..." or "--flag ...").
    if [[ ${#helps[@]} -eq 0 && -n $cont ]] && grep -qE '^[ `]*\[?--' <<<"$line"; then
      helps+=("$cont")
    fi
    cont=""
    [[ ${#helps[@]} -eq 1 ]] && cont=${helps[0]}
    if [[ ${#helps[@]} -eq 0 ]]; then
      sub=$(grep -oE '(^|[ `/])kvtier (store|eval|budgets|policy|calibrate|conversations)( |$)' <<<"$line" | head -1 |
        sed -E 's/.*kvtier ([a-z]+).*/\1/' || true)
      [[ -n $sub ]] && helps+=("$TMP/tool-$sub.help" "$TMP/kvtier.help")
    fi
    [[ ${#helps[@]} -gt 0 ]] || continue
    for f in $flags; do
      [[ $f == help || $f == helpfull || $f == flagfile ]] && continue
      checked=$((checked + 1))
      if ! grep -qE -- "--$f( \(|=|\]| |$)" "${helps[@]}"; then
        echo "$rel:$n: --$f is not a flag of $(basename "${helps[0]}" .help): $line"
        bad=1
      fi
    done
  done <"$doc"
  for t in $(grep -oE '`make [a-z][a-z0-9-]*' "$doc" | sed 's/`make //' | sort -u); do
    grep -qE "^$t:" "$SRC/Makefile" || { echo "$rel: \`make $t\` is no target of the Makefile"; bad=1; }
  done
done
if ((bad)); then echo "docs_commands_test: the docs above name flags or targets that do not exist"; exit 1; fi
echo "docs_commands_test: $checked flags in ${#docs[@]} documents, all known"
