#!/usr/bin/env bash
# RL on the GPU, step by step (run from the repository root; the entry point needs the wheels
# of ../shared/tools/gpu-wheels on PYTHONPATH). Each step runs under its own time limit with its
# output in $OUT/<step>.log; a line per step (exit status, seconds, last line) ends the run.
# Run directories go to runs/ on the machine; the RL steps end with their per-phase table.
#
#   bash experiments/bench/rl_suite.sh mismatch-small overhead-medium   # some steps
#   bash experiments/bench/rl_suite.sh --list                           # the steps
set -u
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT" runs
# Programs compiled by one step are loaded by the next (the machine starts with no cache).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
PY=${PYTHON:-python3}
BENCH=experiments/bench
RUN="$PY -m experiments run"
MEDIUM=configs/reasoning/medium.yaml
PHASES="$PY $BENCH/rl_phases.py"

# name | time limit (s) | command
STEPS=(
  "mismatch-small|400|for b in xla pallas; do $RUN configs/trace_mismatch.yaml model=small batch=32 prompt_len=16 max_new_tokens=64 backend=\$b plot=false --run-dir runs/mismatch-\$b; done"
  "overhead-medium|420|$PY $BENCH/trace_overhead.py --preset medium --batch 256 --prompt-len 32 --new 48 --repeats 3"
  "smoke-medium|480|$RUN $MEDIUM experiment=fp4_trace warm_start.steps=20 steps=6 eval_every=3 eval_problems=64 --run-dir runs/smoke-trace && $PHASES runs/smoke-trace"
  "warm-start-medium|540|$RUN $MEDIUM steps=0 --run-dir runs/ws-medium"
  "compile-scaling|540|for l in 2 4 8; do $PY $BENCH/trace_overhead.py --preset medium --layers \$l --batch 64 --prompt-len 16 --new 16 --repeats 1 2>&1 | grep -E 'first call|layers'; done"
  "modes-medium|540|$RUN $MEDIUM steps=0 warm_start.steps=50 --run-dir runs/ws-modes && for e in bf16_rollout fp4_rollout_bf16_train fp4_qat fp4_trace fp4_trace_all; do $RUN $MEDIUM experiment=\$e warm_start.steps=0 init_checkpoint=runs/ws-modes steps=5 eval_every=100 eval_problems=32 --run-dir runs/modes-\$e || exit 1; done; $PHASES runs/modes-*"
)

if [ "${1:-}" = "--list" ]; then
  for s in "${STEPS[@]}"; do echo "$s"; done
  exit 0
fi

# The steps named, in the order given (default: all, in the table's order).
selected=()
if [ $# -eq 0 ]; then
  selected=("${STEPS[@]}")
else
  for want in "$@"; do
    found=0
    for s in "${STEPS[@]}"; do
      if [ "${s%%|*}" = "$want" ]; then selected+=("$s"); found=1; fi
    done
    [ $found = 1 ] || { echo "rl_suite.sh: no step named $want (see --list)" >&2; exit 2; }
  done
fi

summary=()
for s in "${selected[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  echo "== $name ($limit s): $cmd"
  start=$(date +%s)
  timeout "$limit" bash -c "$cmd" >"$OUT/$name.log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  tail -n 30 "$OUT/$name.log"
  summary+=("$name rc=$rc ${secs}s: $(tail -n 1 "$OUT/$name.log" | cut -c1-150)")
done
echo
echo "== summary"
for line in "${summary[@]}"; do echo "$line"; done
