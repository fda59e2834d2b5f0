#!/usr/bin/env bash
# One device call: set up the GPU environment of scripts/env.sh (.venv-gpu over
# the system Python; jax-triton from the carried .whl/, no network needed), run
# the GPU tests and the benchmarks, and leave logs / JSON / PNG under $OUT.
#   bash scripts/gpu.sh [tests|bench|all] [op ...]
#   bash scripts/gpu.sh files tests/test_x.py "tests/test_y.py@<pytest -k expression>" ...
#   bash scripts/gpu.sh suites      (suite1 and suite2 below on two GPUs at once, if there are two)
#   bash scripts/gpu.sh parallel "<file;file@-k expression;...>" "<stream 2>" ...
#     each argument a stream of `files` (entries separated by ';'), the streams run at
#     once, each stopping before ${GPU_TEST_BUDGET_S:-550} s, logs under $OUT/s<i>/.
#     NOTE: the whole suite fits two 10-minute calls this way, where one file per
#     line took four: PARALLEL_SUITE_1 / _2 below, run with the default budget:
#     bash scripts/gpu.sh parallel suite1   (then suite2)
#     Measured (H200, 2026-11-25, results/2026-11-25-host-final/gpu_tests_summary.txt):
#     at 9292861, five streams in the first call took 230-470 s and four in the second
#     215-260 s. A second run of that first call (d099b9e) was slower: lightning 410 s
#     instead of 332, and at a 470 s budget the two prefix parts, properties and merge
#     were cut (93%, 70%, 33% and 57% through, no failure before the cut). So the
#     prefix's real-size part (414 s even alone) now runs with the lighter second call
#     and properties gets a stream of its own; this split has not yet run as a whole.
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
# the two calls of the whole suite (see parallel above)
PARALLEL_SUITE_1=(
  "tests/test_prefix_prefill.py@not real_sizes and not cache_layout_matrix and not plans_build"
  "tests/test_lightning_attention.py"
  "tests/test_properties.py"
  "tests/test_lightning_backward.py;tests/test_merge_attn_states.py;tests/test_merge_backward.py;tests/test_vmap.py;tests/test_spmd.py"
  "tests/test_unified_attention.py@not real_sizes and not cuda_graph")
PARALLEL_SUITE_2=(
  "tests/test_prefix_prefill.py@real_sizes or cache_layout_matrix or plans_build"
  "tests/test_blocksparse_attention.py;tests/test_autograd_safety.py"
  "tests/test_blocksparse_backward.py;tests/test_architecture.py;tests/test_packaging.py;tests/test_bench_summary.py;tests/test_fp8_rounding.py;tests/test_docs.py"
  "tests/test_lightning_varlen.py;tests/test_index_validation.py;tests/test_scalar_policy.py;tests/test_lightning_cp.py;tests/test_shard_invariance.py"
  "tests/test_vllm_signatures.py;tests/test_dtensor.py;tests/test_offline_compile.py;tests/test_call_memo.py;tests/test_example_scale.py;tests/test_reshape_and_cache_flash.py"
  "tests/test_unified_attention.py@real_sizes or cuda_graph;tests/test_unified_prefill.py;tests/test_unified_decode_invariance.py")
if [[ $what == suites ]]; then
  # both calls' suites in one: suite1 on GPU 0 and suite2 on GPU 1 at once where two GPUs
  # are visible (a two-GPU machine halves the wall time), else one after the other
  ngpu=$(nvidia-smi -L | wc -l)
  if (( ngpu >= 2 )); then
    CUDA_VISIBLE_DEVICES=0 OUT="$OUT/suite1" bash "$0" parallel suite1 > "$OUT/suite1.log" 2>&1 &
    p1=$!
    CUDA_VISIBLE_DEVICES=1 OUT="$OUT/suite2" bash "$0" parallel suite2 > "$OUT/suite2.log" 2>&1 &
    p2=$!
    wait $p1 || rc=1
    wait $p2 || rc=1
  else
    OUT="$OUT/suite1" bash "$0" parallel suite1 > "$OUT/suite1.log" 2>&1 || rc=1
    OUT="$OUT/suite2" bash "$0" parallel suite2 > "$OUT/suite2.log" 2>&1 || rc=1
  fi
  for f in "$OUT/suite1.log" "$OUT/suite2.log"; do echo "== $f"; grep -v "^NVIDIA" "$f"; done
  exit $rc
fi
if [[ $what == parallel ]]; then
  [[ ${#ops[@]} == 1 && ${ops[0]} == suite1 ]] && ops=("${PARALLEL_SUITE_1[@]}")
  [[ ${#ops[@]} == 1 && ${ops[0]} == suite2 ]] && ops=("${PARALLEL_SUITE_2[@]}")
  pids=()
  for s in "${ops[@]}"; do
    i=$(( ${#pids[@]} + 1 )); mkdir -p "$OUT/s$i"
    IFS=';' read -ra stream <<< "$s"
    OUT="$OUT/s$i" bash "$0" files "${stream[@]}" > "$OUT/s$i/stream.log" 2>&1 &
    pids+=($!)
  done
  for ((j = 1; j <= ${#pids[@]}; j++)); do
    wait "${pids[j - 1]}" || rc=1   # a stream's rc: 1 on a failed or unrun file
    echo "== stream $j"; grep -v "^NVIDIA" "$OUT/s$j/stream.log"
  done
  exit $rc
fi
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
