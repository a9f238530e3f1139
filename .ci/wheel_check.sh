#!/usr/bin/env bash
# Build srpo's wheel and install it, with its dependencies at the pinned versions, into a clean
# virtualenv outside the checkout; then run `srpo --help` and `srpo models list` from there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
.venv/bin/python -m build --wheel --no-isolation --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/srpo-*.whl)
echo "built $(basename "$WHEEL")"
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -qq torch==2.13.0
"$WORK/venv/bin/pip" install -qq -c "$ROOT/constraints.txt" "$WHEEL"
cd "$WORK"  # nothing of the checkout on the path
"$WORK/venv/bin/python" -c "import srpo, sys; assert srpo.__file__.startswith('$WORK/venv'), srpo.__file__; print('srpo from', srpo.__file__)"
"$WORK/venv/bin/python" -c "import srpo.apps.study, srpo.apps.sft, srpo.runs.checkpoint, srpo.train, srpo.rollout, srpo.parallel, srpo.types"
"$WORK/venv/bin/srpo" --help > /dev/null
"$WORK/venv/bin/srpo" models list
echo "wheel check: ok"
