#!/usr/bin/env bash
# compute-sanitizer (memcheck, initcheck, racecheck) over every kernel variant
# (Triton and Gluon, torch and JAX) at odd shapes: tools/sanitize_cases.py, one
# process per (tool, adapter), so that each log holds one framework only.
# Same environment as scripts/gpu.sh (scripts/env.sh: .venv-gpu, jax-triton from
# the carried .whl/). Through the device tool, one call:
#   run(command="bash scripts/sanitize.sh", carry=[".whl"])
# The script keeps to SANITIZE_BUDGET and records what it could not run as
# "not_run"; racecheck is the slow one. Tools left over get calls of their own
# (on a machine still warm, Triton's cache is filled: skip the warm-up):
#   run(command="SANITIZE_TOOLS=racecheck SANITIZE_WARMUP=0 bash scripts/sanitize.sh", carry=[".whl"])
# Writes under $OUT (default results/): sanitize_<tool>_<adapter>.log per run,
# sanitize_plain_<adapter>.log (the warm-up without a sanitizer), and
# sanitize_summary.json: per (tool, adapter) the exit code (0 clean, 99 the
# sanitizer found errors, 1 a case failed, 124/137 timed out), wall time, cases
# ok / failed / skipped and the sanitizer's "ERROR SUMMARY" (and racecheck's
# "RACECHECK SUMMARY") line.
# Environment knobs:
#   SANITIZE_TOOLS     tools, in order (default "memcheck initcheck racecheck")
#   SANITIZE_ADAPTERS  adapters (default "torch jax")
#   SANITIZE_TIMEOUT   seconds per sanitizer invocation (default 240)
#   SANITIZE_BUDGET    seconds for the whole script after setup (default 420): an
#                      invocation gets min(SANITIZE_TIMEOUT, what is left), none
#                      below 30 s (recorded as "not run"), so one device call
#                      (at most 600 s) always ends with a summary
#   SANITIZE_ONLY      passed as --only (a substring of the case names)
#   SANITIZE_SEED      numpy seed for every invocation (default: fresh, printed)
#   SANITIZE_WARMUP    1 (default): run the cases once per adapter without a
#                      sanitizer first (fills Triton's cache, baseline counts); 0: skip
#   COMPUTE_SANITIZER  path of compute-sanitizer (default: PATH, then /usr/local/cuda*/bin)
source "$(dirname "$0")/env.sh"   # exits on failure (set -e there)
set +eu -o pipefail
export PYTHONUNBUFFERED=1
# every torch tensor and every JAX buffer its own allocation, so that reads and
# writes past one tensor's end are visible to memcheck
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
OUT=${OUT:-$PWD/results}; mkdir -p "$OUT"
read -r -a tools <<< "${SANITIZE_TOOLS:-memcheck initcheck racecheck}"
read -r -a adapters <<< "${SANITIZE_ADAPTERS:-torch jax}"
per_call=${SANITIZE_TIMEOUT:-240}
budget=${SANITIZE_BUDGET:-420}
seed=${SANITIZE_SEED:-$(( (RANDOM << 15 | RANDOM) ))}
case_args=(--seed "$seed")
[[ -n ${SANITIZE_ONLY:-} ]] && case_args+=(--only "$SANITIZE_ONLY")

sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer)}
if [[ -z $sanitizer ]]; then
  sanitizer=$(ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | sort -V | tail -1)
fi
if [[ -z $sanitizer || ! -x $sanitizer ]]; then
  echo "compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$sanitizer" --version | tail -1
echo "seed $seed; tools ${tools[*]}; adapters ${adapters[*]}; timeout ${per_call} s; budget ${budget} s"

start=$SECONDS
rows=$(mktemp)
overall=0

record() {  # tool adapter rc wall log
  local log=$5 ok fail skip summary
  ok=$(grep -c '^ok ' "$log" 2>/dev/null); fail=$(grep -c '^FAIL ' "$log" 2>/dev/null)
  skip=$(grep -c '^skip ' "$log" 2>/dev/null)
  summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" 2>/dev/null | sed 's/^=* *//' | paste -sd ';' -)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${ok:-0}" "${fail:-0}" \
    "${skip:-0}" "$summary" "$(basename "$log")" >> "$rows"
  printf '%-10s %-5s rc=%-3s %4ss  ok=%s fail=%s skip=%s  %s\n' "$1" "$2" "$3" "$4" "${ok:-0}" \
    "${fail:-0}" "${skip:-0}" "$summary"
}

if [[ ${SANITIZE_WARMUP:-1} == 1 ]]; then
  for a in "${adapters[@]}"; do
    log="$OUT/sanitize_plain_${a}.log"
    t0=$SECONDS
    timeout -k 10 "$per_call" "$PYTHON_BIN" -m tools.sanitize_cases --adapter "$a" "${case_args[@]}" \
      > "$log" 2>&1
    rc=$?
    record plain "$a" "$rc" $((SECONDS - t0)) "$log"
    [[ $rc != 0 ]] && { overall=1; grep -E '^FAIL ' "$log" | head -20; }
  done
fi

for tool in "${tools[@]}"; do
  for a in "${adapters[@]}"; do
    log="$OUT/sanitize_${tool}_${a}.log"
    left=$(( budget - (SECONDS - start) ))
    limit=$(( left < per_call ? left : per_call ))
    if (( limit < 30 )); then
      echo "not run (budget)" > "$log"
      record "$tool" "$a" "not_run" 0 "$log"
      overall=1
      continue
    fi
    t0=$SECONDS
    timeout -k 10 "$limit" "$sanitizer" --tool "$tool" --error-exitcode 99 --target-processes all \
      "$PYTHON_BIN" -m tools.sanitize_cases --adapter "$a" "${case_args[@]}" > "$log" 2>&1
    rc=$?
    record "$tool" "$a" "$rc" $((SECONDS - t0)) "$log"
    if [[ $rc != 0 ]]; then
      overall=1
      # what was reported (numbers dropped) and the kernels it was reported in
      grep -E '^(FAIL |========= +(Invalid|Uninitialized|Race|Error|Warning|Program hit))' "$log" \
        | sed -E 's/0x[0-9a-f]+/0x../g; s/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -12
      grep -E '^========= +at ' "$log" | sed -E 's/^=* +at //; s/\+0x[0-9a-f]+.*//' \
        | sort | uniq -c | sort -rn | head -12
    fi
  done
done

"$PYTHON_BIN" - "$rows" "$OUT/sanitize_summary.json" "$seed" "$sanitizer" <<'PY'
import json, subprocess, sys
rows_path, out_path, seed, sanitizer = sys.argv[1:]
runs = []
for line in open(rows_path):
    tool, adapter, rc, wall, ok, fail, skip, summary, log = line.rstrip("\n").split("\t")
    runs.append(dict(tool=tool, adapter=adapter,
                     exit_code=int(rc) if rc.lstrip("-").isdigit() else rc,
                     timed_out=rc in ("124", "137"), wall_s=int(wall), cases_ok=int(ok),
                     cases_failed=int(fail), cases_skipped=int(skip),
                     error_summary=summary or None, log=log))
def output(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""
version = output([sanitizer, "--version"])
gpu = output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
json.dump(dict(seed=int(seed), sanitizer=version.splitlines()[-1] if version else sanitizer, gpu=gpu,
               runs=runs), open(out_path, "w"), indent=1)
print(f"wrote {out_path}")
PY
rm -f "$rows"
echo "total $((SECONDS - start)) s"
exit $overall
