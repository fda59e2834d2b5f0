#!/usr/bin/env bash
# Run the test suite (CPU: Triton interpreter; GPU machine: real kernels).
source "$(dirname "$0")/env.sh"
exec "$PYTHON_BIN" -m pytest -q "$@"
