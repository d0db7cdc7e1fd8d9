#!/usr/bin/env bash
# Run every benchmark, PyTorch in the same process, writing bench/results/<name>_<suffix>.json.
#
#   On the H200 (full sizes, ~3-5 minutes, keep it under ~8):
#     source .gpu/setup.sh && bash bench/run_all.sh          # suffix h200
#     python bench/report.py                                 # tables into docs/performance.md
#   Smoke test on lavapipe (tiny sizes, few repeats; ~1.5 minutes):
#     bash bench/run_all.sh --quick                          # -> bench/results/quick/*_lavapipe.json
#
# Usage: bash bench/run_all.sh [--quick] [SUFFIX] [SCRIPT ...]
#   SUFFIX defaults to h200 (full) or lavapipe (--quick); SCRIPTs default to all of them
#   (matmul bandwidth attention conv dispatch mlp compile_cache). Each script gets at most
#   $BENCH_TIMEOUT seconds (default 300); scripts rewrite their result file after every row, so one cut
#   short keeps what it measured ("complete": false). A failing script does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
QUICK=""
SUFFIX=""
SCRIPTS=()
for a in "$@"; do
  case "$a" in
    --quick) QUICK="--quick" ;;
    matmul|bandwidth|attention|conv|dispatch|mlp|compile_cache) SCRIPTS+=("$a") ;;
    *) SUFFIX="$a" ;;
  esac
done
if [ -z "$SUFFIX" ]; then
  if [ -n "$QUICK" ]; then SUFFIX=lavapipe; else SUFFIX=h200; fi
fi
if [ ${#SCRIPTS[@]} -eq 0 ]; then
  SCRIPTS=(matmul bandwidth attention conv dispatch mlp compile_cache)
fi
TIMEOUT=${BENCH_TIMEOUT:-300}
failed=()
summary=()
t_all=$(date +%s.%N)
for s in "${SCRIPTS[@]}"; do
  if [ "$s" = mlp ]; then
    # bench/mlp.py predates --quick: few repeats, and its file goes under quick/ by name.
    if [ -n "$QUICK" ]; then
      args=(--repeats 3 --out-name "quick/mlp_$SUFFIX")
    else
      args=(--out-name "mlp_$SUFFIX")
    fi
  else
    args=($QUICK --out-name "${s}_$SUFFIX")
  fi
  echo "=== bench/$s.py ${args[*]}"
  t0=$(date +%s.%N)
  timeout "$TIMEOUT" "$PY" "bench/$s.py" "${args[@]}"
  rc=$?
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  summary+=("$s: ${dt} s (exit $rc)")
  [ $rc -eq 0 ] || failed+=("$s")
done
echo "=== summary"
printf '  %s\n' "${summary[@]}"
awk -v a="$t_all" -v b="$(date +%s.%N)" 'BEGIN { printf "  total: %.1f s\n", b - a }'
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
