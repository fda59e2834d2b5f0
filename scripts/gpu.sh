#!/usr/bin/env bash
# One device call: set up the GPU environment of scripts/env.sh (.venv-gpu over
# the system Python; jax-triton from the carried .whl/, no network needed), run
# the GPU tests and the benchmarks, and leave logs / JSON / PNG under $OUT.
#   bash scripts/gpu.sh [tests|bench|all] [op ...]
#   bash scripts/gpu.sh files tests/test_x.py "tests/test_y.py@<pytest -k expression>" ...
# e.g. run(command="bash scripts/gpu.sh all merge_attn_states", carry=[".whl"])
source "$(dirname "$0")/env.sh"   # exits on failure (set -e there)
set +eu -o pipefail
export PYTHONUNBUFFERED=1
# the property tests' larger hypothesis profile (tests/conftest.py)
export TANDEM_HYPOTHESIS_PROFILE=${TANDEM_HYPOTHESIS_PROFILE:-gpu}
OUT=${OUT:-$PWD/results}; mkdir -p "$OUT"
what=${1:-all}; shift || true
ops=("$@")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
rc=0
if [[ $what == files ]]; then
  # one pytest per test file (file or file@-k-expression), each log under $OUT, stopping
  # before ${GPU_TEST_BUDGET_S:-550} s: fits the test files into one time-limited device call
  t0=$SECONDS
  for f in "${ops[@]}"; do
    left=$(( ${GPU_TEST_BUDGET_S:-550} - (SECONDS - t0) ))
    if (( left < 30 )); then echo "NOT RUN $f"; rc=1; continue; fi
    k=""; if [[ $f == *@* ]]; then k=${f#*@}; f=${f%%@*}; fi
    b=$(basename "$f" .py)
    timeout -s KILL "$left" "$PYTHON_BIN" -m pytest -q -p no:cacheprovider "$f" ${k:+-k "$k"} > "$OUT/$b.log" 2>&1 || rc=1
    echo "$f t=$((SECONDS - t0)) :: $(tail -1 "$OUT/$b.log")"
    grep "^FAILED" "$OUT/$b.log" | head -5
  done
fi
if [[ $what == tests || $what == all ]]; then
  files=()
  for op in "${ops[@]}"; do files+=("tests/test_${op}.py"); done
  [[ ${#files[@]} == 0 ]] && files=(tests)
  "$PYTHON_BIN" -m pytest "${files[@]}" -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  "$PYTHON_BIN" -m benchmarks.run "${ops[@]}" --out "$OUT" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
exit $rc
