#!/usr/bin/env bash
# clang's -Wthread-safety over the code annotated with ABSL_GUARDED_BY and
# friends (base/, worker/, services/worker/, cachestore/, controller/, model/thread_pool,
# refengine/demo,
# services/store/, services/controller/): a field read
# without its mutex, or a REQUIRES broken, fails the check. GCC ignores the
# annotations, so this pass is what enforces them. Uses the build's
# compile_commands.json for the include paths.
#   scripts/check_thread_safety.sh BUILD_DIR
set -euo pipefail
BUILD_DIR=${1:?usage: $0 BUILD_DIR}
cd "$(dirname "$0")/.."
CLANG=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$CLANG" ]; then
  echo "check_thread_safety: clang++ not found (scripts/kvtier.sh deps installs it)" >&2
  exit 1
fi
DB="$BUILD_DIR/compile_commands.json"
[ -f "$DB" ] || { echo "check_thread_safety: no $DB (configure first)" >&2; exit 1; }
FILES=$(ls base/*.cc worker/*.cc worker/device/*.cc services/worker/*.cc cachestore/*.cc \
  controller/*.cc services/store/*.cc services/controller/*.cc client/controller_client.cc \
  model/thread_pool.cc refengine/demo.cc | grep -v '_test.cc$' | grep -v '_cuda.cc$')
fail=0
n=0
for f in $FILES; do
  # The file's include flags from the build (-I, -isystem, -D), nothing else.
  flags=$(python3 - "$DB" "$PWD/$f" <<'PY'
import json, shlex, sys
db, path = sys.argv[1], sys.argv[2]
for e in json.load(open(db)):
    if e["file"] == path:
        args = shlex.split(e["command"])
        out, i = [], 0
        while i < len(args):
            a = args[i]
            if a in ("-isystem", "-I", "-D") and i + 1 < len(args):
                out += [a, args[i + 1]]; i += 2; continue
            if a.startswith(("-I", "-D")):
                out.append(a)
            i += 1
        print(" ".join(shlex.quote(x) for x in out))
        break
PY
)
  [ -n "$flags" ] || continue
  n=$((n + 1))
  if ! eval "$CLANG" -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety \
      -Wno-unknown-warning-option $flags "$f"; then
    fail=1
  fi
done
if ((fail)); then
  echo "check_thread_safety: clang -Wthread-safety found problems above"
  exit 1
fi
echo "check_thread_safety: OK ($n files)"
