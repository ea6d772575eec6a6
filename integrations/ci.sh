#!/usr/bin/env bash
# The engine cross-checks (docs/scale.md): RSPO's verl plug-in against verl's own functions, in a virtual
# environment of its own (verl pins transformers < 5.11 and pulls ray and tensordict), built once and cached;
# RSPOGRPOTrainer against TRL's GRPOTrainer, in this python beside the project's stack. The versions are pinned
# here and in integrations/*/pyproject.toml; the tests name the engine API that a version bump broke.
#   bash integrations/ci.sh        # first run ~2.5 min (verl's venv, ~1.9 GB), then ~1 min
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.13.0 VERL=0.9.1 TRL=1.16.0 PYTEST=9.0.3
VENV=${RSPO_VERL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rspo-engines/verl-$VERL-torch-$TORCH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # the tests are small; leave the other core alone

quiet() {   # run a pip command, showing its output only when it fails (the index mirror is verbose)
    local log; log=$(mktemp)
    "$@" >"$log" 2>&1 || { cat "$log"; rm -f "$log"; return 1; }
    rm -f "$log"
}

pinned='from importlib.metadata import version as v
assert v("verl") == "'$VERL'" and v("torch").split("+")[0] == "'$TORCH'" and v("pytest") == "'$PYTEST'"'
if ! "$VENV/bin/python" -c "$pinned" 2>/dev/null; then
    echo "building verl's environment in $VENV (once; ~2 min)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    quiet "$VENV/bin/pip" install torch==$TORCH       # first, so that verl does not pull a CUDA torch
    quiet "$VENV/bin/pip" install verl==$VERL pytest==$PYTEST
    quiet "$VENV/bin/pip" uninstall -y kernels || true   # verl may pull it; it fetches kernels from a hub
fi
# This checkout's rspo.py and plug-in, editable (the cached venv may have pointed at another clone).
quiet "$VENV/bin/pip" install --no-deps -e . -e integrations/verl
quiet "$PY" -m pip install trl==$TRL

LOG=$(mktemp)
export RSPO_CROSSCHECK_LOG=$LOG
status=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider integrations/verl || status=1
PYTHONPATH=.:integrations/trl "$PY" -m pytest -q -p no:cacheprovider integrations/trl || status=1
echo "--- engine cross-checks: maximum differences, the TRL run"
cat "$LOG"
rm -f "$LOG"
exit $status
