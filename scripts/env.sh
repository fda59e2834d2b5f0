# Sourced by demo.sh and test.sh: create .venv and install the pinned CPU
# requirements once (re-installs when requirements/cpu.txt changes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
stamp="$VENV/.requirements-$(sha256sum "$ROOT/requirements/cpu.txt" | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  echo "setting up $VENV (pinned versions from requirements/cpu.txt) ..." >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements/cpu.txt" >&2
  touch "$stamp"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PYTHON_BIN="$VENV/bin/python"
cd "$ROOT"
