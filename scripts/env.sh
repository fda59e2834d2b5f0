# Sourced by demo.sh, test.sh and gpu.sh: create a virtual environment with the
# pinned requirements once (re-installs when the requirements file changes).
#   no NVIDIA GPU: .venv     from requirements/cpu.txt (kernels run under Triton's interpreter)
#   NVIDIA GPU:    .venv-gpu from requirements/gpu.txt (CUDA builds of torch and jax, real kernels),
#                  made with --system-site-packages so that pinned versions already
#                  installed in the system Python are used as they are.
# TANDEM_ENV=cpu|gpu overrides the detection.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
case "${TANDEM_ENV:-auto}" in
  cpu) use_gpu=0 ;;
  gpu) use_gpu=1 ;;
  auto) if [[ -e /dev/nvidia0 ]] || nvidia-smi -L >/dev/null 2>&1; then use_gpu=1; else use_gpu=0; fi ;;
  *) echo "TANDEM_ENV: expected cpu, gpu or auto, got '$TANDEM_ENV'" >&2; exit 2 ;;
esac
if [[ $use_gpu == 0 ]]; then
  VENV="$ROOT/.venv"
  stamp="$VENV/.requirements-$(sha256sum "$ROOT/requirements/cpu.txt" | cut -c1-16)"
  if [[ ! -f "$stamp" ]]; then
    echo "setting up $VENV (pinned versions from requirements/cpu.txt) ..." >&2
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements/cpu.txt" >&2
    touch "$stamp"
  fi
else
  VENV="$ROOT/.venv-gpu"
  stamp="$VENV/.requirements-$(sha256sum "$ROOT/requirements/gpu.txt" | cut -c1-16)"
  if [[ ! -f "$stamp" ]]; then
    echo "setting up $VENV (NVIDIA GPU found; pinned versions from requirements/gpu.txt) ..." >&2
    "$PY" -m venv --system-site-packages "$VENV"
    echo "*" > "$VENV/.gitignore"   # keep the environment out of git
    # If $PY is itself a virtual environment (python3 on our GPU image is one),
    # --system-site-packages only reaches the base interpreter's packages: add
    # $PY's own site directories too, after the new environment's own.
    "$PY" - > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_base_python.pth" <<'PTH'
import site, sys
if sys.prefix != sys.base_prefix:
    print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages([sys.prefix])))
PTH
    pip_install=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements/gpu.txt")
    # wheels carried in .whl/ (e.g. jax-triton for a machine without network)
    [[ -d "$ROOT/.whl" ]] && pip_install+=(--find-links "$ROOT/.whl")
    # Offline first: a machine whose system Python already has the pinned
    # versions (and .whl/ the rest) installs without touching the network;
    # otherwise download what is missing (torch from the PyTorch CUDA index).
    if ! "${pip_install[@]}" --no-index >/dev/null 2>&1; then
      "${pip_install[@]}" >&2
    fi
    touch "$stamp"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PYTHON_BIN="$VENV/bin/python"
cd "$ROOT"
