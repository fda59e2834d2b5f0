#!/usr/bin/env bash
# Run every public op through both adapters on identical inputs and print agreement and timings.
source "$(dirname "$0")/env.sh"
exec "$PYTHON_BIN" demo.py "$@"
