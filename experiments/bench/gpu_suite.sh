#!/usr/bin/env bash
# The kernels' and RL's GPU checks and timings, step by step, on a machine with the GPU (run
# from the repository root with the machine's python3). Each step runs under its own time limit with its
# output in $OUT/<step>.log; a line per step (exit status, seconds, last line) ends the run.
#
#   bash experiments/bench/gpu_suite.sh                        # every step, in order
#   bash experiments/bench/gpu_suite.sh attention-tests attention-mgpu   # some of them
#   bash experiments/bench/gpu_suite.sh --list                 # the steps and their commands
set -u
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}  # keeps the wheels of ../shared/tools/gpu-wheels (the RL steps need them)
PY=${PYTHON:-python3}
BENCH=experiments/bench
RUN="$PY -m experiments run"
MEDIUM=${RECIPE:-configs/reasoning/medium.yaml}  # the RL steps' recipe (RECIPE: another preset's)
PHASES="$PY $BENCH/rl_phases.py"
# The suite's own helpers are lower case: the knobs a caller sets (RECIPE, WS, WS_MAP, RL_MIN,
# RL_ARGS, SWEEP, ONLY, MIN_CELL, CACHE_MB, OUT, PYTHON) are upper case and reach the steps as they were given.
# a run's records (metrics, results, curves; not its parameters) into $OUT/<run>.tgz
keep="keep() { tar czf $OUT/\$(basename \$1).tgz --exclude=checkpoints --exclude=policy --exclude=guidance_spill \$1; }; keep"
# the recipe's warm start, made once per machine (runs/ws-modes) for the steps that start from it
ws_once="ws() { [ -f runs/ws-modes/results.json ] || $RUN $MEDIUM steps=0 eval_problems=0 checkpoint_every=0 --run-dir runs/ws-modes > $OUT/ws-modes.log 2>&1; }; ws"
from_ws="warm_start.steps=0 init_checkpoint=runs/ws-modes"
# the modes named, after the recipe's warm start
modes_of="modes() { export JAX_LOG_COMPILES=1 PYTHONFAULTHANDLER=1; $ws_once || return 1; for e in \"\$@\"; do timeout -s ABRT 230 $RUN $MEDIUM experiment=\$e warm_start.steps=0 init_checkpoint=runs/ws-modes steps=12 eval_every=12 checkpoint_every=0 --run-dir runs/modes-\$e > $OUT/modes-\$e.log 2>&1; echo \"\$e rc=\$?\"; grep -o 'Finished .* in [0-9.e-]* sec' $OUT/modes-\$e.log | awk '\$(NF-1) > 3 {print \$(NF-1), \$0}' | sort -g | tail -8; grep -v '^ *@\\|Finished\\|^train \\[' $OUT/modes-\$e.log | tail -4; rm -rf runs/modes-\$e/checkpoints runs/modes-\$e/policy; done; $PHASES runs/modes-*; }; modes"
# Programs compiled by one step are loaded by the next (the machine starts with no cache).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
# ... and by the next call: a machine starts bare, so the suite unpacks the compiled programs an
# earlier call brought back (carried in $CACHE_IN: `carry: [".whl", ".gpu-cache"]`) and, at the
# end, packs this call's newest ones into $OUT/jax-cache.tgz.part-* (at most CACHE_MB
# compressed, in 15 MiB parts: what the device tool returns); `mkdir -p .gpu-cache && cp` them
# there for the next call. Entries are keyed by program, device kind and JAX version, so a cache
# from another GPU kind or tree is only missed, never wrong.
CACHE_IN=${CACHE_IN:-.gpu-cache}
CACHE_MB=${CACHE_MB:-44}
mkdir -p "$JAX_COMPILATION_CACHE_DIR"
if compgen -G "$CACHE_IN/jax-cache.tgz.part-*" >/dev/null; then
  cat "$CACHE_IN"/jax-cache.tgz.part-* | tar xzf - -C "$JAX_COMPILATION_CACHE_DIR" \
    && echo "compile cache: $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) programs from $CACHE_IN"
fi
pack_cache() {
  # newest first, until the compressed archive fits CACHE_MB; each try scales the count by how
  # far the last archive overshot, and the one that fits is the one split
  local list=$OUT/.cache-files tgz=$OUT/.cache.tgz limit=$((CACHE_MB * 1048576)) n total
  (cd "$JAX_COMPILATION_CACHE_DIR" && ls -t) > "$list" 2>/dev/null || return 0
  n=$(wc -l < "$list")
  rm -f "$OUT"/jax-cache.tgz.part-*
  for _ in 1 2 3 4; do
    [ "$n" -gt 0 ] || break
    head -n "$n" "$list" | tar czf "$tgz" -C "$JAX_COMPILATION_CACHE_DIR" -T -
    total=$(wc -c < "$tgz")
    if [ "$total" -le "$limit" ]; then
      split -b 15M "$tgz" "$OUT/jax-cache.tgz.part-"
      echo "compile cache: $n of $(wc -l < "$list") programs packed ($((total / 1048576)) MiB)"
      break
    fi
    n=$((n * limit * 9 / 10 / total))
  done
  rm -f "$list" "$tgz"
}

# name | time limit (s) | command
STEPS=(
  "attention-tests|400|$PY -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels/test_fp4_decode_attention.py"
  "attention-mgpu|200|$PY $BENCH/fp4_attention.py --mgpu --shapes 32x8192 --grid '[{}, {\"stages\": 3}, {\"num_splits\": 4}, {\"num_splits\": 16}, {\"p_parts\": 1}, {\"overlap_v\": true}]'"
  "attention-table|420|$PY $BENCH/fp4_attention.py"
  "attention-fused|300|$PY $BENCH/fp4_attention.py --fused"
  "matmul-table|590|$PY $BENCH/fp4_matmul.py"
  "matmul-tests|300|$PY -m pytest -q -m gpu -p no:cacheprovider tests/fp4/test_quantize.py tests/pallas_kernels/test_fp4_activation.py tests/pallas_kernels/test_fp4_matmul_mgpu.py"
  "matmul-grouped-tests|240|$PY -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels/test_fp4_matmul_mgpu.py -k grouped"
  "matmul-w4a4|240|$PY $BENCH/fp4_matmul.py --w4a4 --ms 1,16,64"
  "matmul-grouped|360|$PY $BENCH/fp4_matmul.py --grouped-bounds --ms 16,64 --variants '256,3,8,1,xla;256,3,8,1,kernel,t2'"
  "matmul-moe-layer|200|$PY $BENCH/fp4_matmul.py --moe-layer --ms 16,64"
  "matmul-k-split|240|$PY $BENCH/fp4_matmul.py --mgpu --ms 1,16 --variants '256,3,2,1,wk;128,4,2,1,wk;256,4,2,1,wk'"
  "matmul-short-k|300|$PY $BENCH/fp4_matmul.py --mgpu --ms 64,128,256 --shapes 4096,14336 --variants '128,3,1,1;64,4,1,1;128,3,2,2;64,4,2,2;128,4,2,1,wk;64,3,2,1,wk;128,3,2,1'"
  "matmul-bounds|200|$PY $BENCH/fp4_matmul.py --bounds --ms 1,16,64"
  "matmul-dispatch|400|$PY $BENCH/fp4_matmul.py --dispatch --ms 1,16,64,128,256"
  "rollout-qwen3|500|$PY $BENCH/rollout.py --preset qwen3-30b-a3b --layers 4 --engines bf16,trace,bf16-pallas --batches 32 --prompt 64 --gens 128 --mode full --repeats 2"
  # the whole model's FP4 engine (48 layers, 37.8 GB of weights: it fits an 80 GB H100), then
  # both engines at 30 layers (where every BF16 configuration fits an H100), whose programs
  # compile beside the first run (rollout.py --compile-only; that run, without --cache-dir,
  # does not wait for them; the second loads them). The BF16 whole model: rollout-full-bf16.
  "rollout-full|565|export XLA_PYTHON_CLIENT_PREALLOCATE=false; R=\"$PY $BENCH/rollout.py --preset qwen3-30b-a3b --batches 32,64 --prompt 512 --gens 1024,8192 --window 16 --repeats 1\"; C=\"--cache-dir \$JAX_COMPILATION_CACHE_DIR\"; \$R --layers 30 --engines w4a16,bf16-pallas --compile-only \$C & timeout 300 \$R --engines w4a16 --json $OUT/rollout-full.json; timeout 240 \$R --layers 30 --engines w4a16,bf16-pallas \$C --json $OUT/rollout-full-30.json"
  # the BF16 whole model (61.1 GB of weights; at 8 k generation only an H200 holds its cache):
  # generation 1 k fits an H100, 8 k an H200 (the fit check skips what does not fit); its
  # 30-layer decode programs lowered in ~2.5 s and compiled in ~21 s at faa3e77 (74 + 145 s at
  # 34c139d, when the Hopper grouped kernel lowered once per layer)
  "rollout-full-bf16|565|$PY $BENCH/rollout.py --preset qwen3-30b-a3b --engines bf16-pallas --batches 32,64 --prompt 512 --gens 1024,8192 --window 16 --repeats 1 --json $OUT/rollout-full-bf16.json"
  "rollout-full-w4a4|480|$PY $BENCH/rollout.py --preset qwen3-30b-a3b --engines w4a4 --batches 32,64,128 --prompt 512 --gens 1024,8192 --window 16 --repeats 2 --json $OUT/rollout-full-w4a4.json"
  "rollout-full-128|480|$PY $BENCH/rollout.py --preset qwen3-30b-a3b --engines w4a16,bf16-pallas --batches 128 --prompt 512 --gens 1024,8192 --window 16 --repeats 2 --json $OUT/rollout-full-128.json"
  "rollout-layers|480|$PY $BENCH/rollout.py --preset qwen3-30b-a3b --layers 16 --engines w4a16,bf16,bf16-pallas --batches 32,64 --prompt 512 --gens 1024,8192 --window 16 --repeats 2 --json $OUT/rollout-layers.json"
  "rollout-profile|480|$PY $BENCH/rollout.py --preset qwen3-30b-a3b --layers 8 --engines w4a4,bf16-pallas --batches 64 --prompt 512 --gens 1024 --window 16 --repeats 2 --profile --json $OUT/rollout-profile.json"
  # the decode step with XLA's command buffers (CUDA graphs) off, as they come, and over every
  # kind of command the flag takes (loops and custom calls: the kernels) from one command up:
  # whether launching the ~dozens of small ops and kernels a layer bounds the FP4 engine at
  # 45 % of its floor (~135 us a layer beyond its bytes, BENCHMARKS "The whole model on one H100")
  "rollout-graphs|480|for f in --xla_gpu_enable_command_buffer= '' '--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1'; do echo \"XLA_FLAGS=\$f\"; XLA_FLAGS=\"\$f\" timeout 150 $PY $BENCH/rollout.py --preset qwen3-30b-a3b --layers 8 --engines w4a16,bf16-pallas --batches 32 --prompt 512 --gens 1024 --window 16 --repeats 2 | grep -A3 '^engine  '; done"
  "rollout-check|480|for m in window full; do $PY $BENCH/rollout.py --preset qwen3-30b-a3b --layers 8 --engines w4a16 --batches 32 --prompt 512 --gens 1024 --window 16 --repeats 1 --mode \$m; done"
  "engine-tests|300|$PY -m pytest -q -p no:cacheprovider tests/rollout/test_engine_pallas.py"
  # RL (the entry point needs the wheels of ../shared/tools/gpu-wheels; run dirs in runs/)
  "rl-mismatch-small|400|for b in xla pallas; do $RUN configs/trace_mismatch.yaml model=small batch=32 prompt_len=16 max_new_tokens=64 backend=\$b plot=false --run-dir runs/mismatch-\$b; done"
  # JAX's Hopper grouped kernels against XLA's blocked form, 1 to 65,536 rows (the engine's
  # decode step and the trainer's minibatch of the medium recipe)
  "trainer-kernel-tests|300|$PY -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels/test_bf16_grouped_matmul.py"
  # the trainer's expert matmuls at `medium` (a 64-sequence minibatch, a 256-sequence one): the
  # blocked XLA form against JAX's Hopper ragged_dot kernels
  "trainer-matmul|240|$PY $BENCH/grouped_matmul.py --preset medium --tokens 4352,17408"
  # the trainer's scoring pass and one 64-sequence gradient at `medium`, timed, then op by op
  # (the experts' matmul through JAX's Hopper kernels, then in XLA's blocked form; CUDA-graph
  # command buffers off, so that the profile can tell the ops apart)
  "trainer-profile|300|XLA_FLAGS=--xla_gpu_enable_command_buffer= $PY $BENCH/trainer_profile.py --preset medium --batch 256 --minibatch 64 --top 30"
  "trainer-profile-xla|300|XLA_FLAGS=--xla_gpu_enable_command_buffer= $PY $BENCH/trainer_profile.py --preset medium --batch 256 --minibatch 64 --top 30 --expert-matmul xla"
  "trainer-profile-deterministic|300|XLA_FLAGS='--xla_gpu_deterministic_ops=true --xla_gpu_enable_command_buffer=' $PY $BENCH/trainer_profile.py --preset medium --batch 256 --minibatch 64 --top 30 --profile-calls 1"
  # at the recipe's shapes (1,024 sequences of 64 slots scored, minibatches of 128, deterministic
  # ops as medium.yaml runs them): where its 0.95 s of forward and backward a step goes
  "trainer-profile-recipe|360|XLA_FLAGS='--xla_gpu_deterministic_ops=true --xla_gpu_enable_command_buffer=' $PY $BENCH/trainer_profile.py --preset medium --batch 1024 --minibatch 128 --seq 64 --new 48 --top 40 --profile-calls 1"
  # TRACE's guidance path for one `medium` rollout batch of the recipe (1,024 x 64 slots, 344 MiB):
  # device -> host cache -> trainer's device arrays
  "rl-guidance-path|200|$PY $BENCH/guidance_path.py --preset medium --batch 1024 --slots 64"
  "rl-overhead-medium|420|$PY $BENCH/trace_overhead.py --preset medium --batch 256 --prompt-len 32 --new 48 --repeats 3"
  "rl-compile-scaling|540|for l in 2 4 8; do $PY $BENCH/trace_overhead.py --preset medium --layers \$l --batch 64 --prompt-len 16 --new 16 --repeats 1 2>&1 | grep -E 'first call|layers'; done"
  "rl-smoke-medium|480|$RUN $MEDIUM experiment=fp4_trace warm_start.steps=20 steps=6 eval_every=3 eval_problems=64 --run-dir runs/smoke-trace && $PHASES runs/smoke-trace"
  # the recipe's deterministic warm start twice at once (two processes, each compiling its own
  # programs): the same start_policy_sha256 is what lets a study's modes start from one policy
  # across calls; run it again in another call and compare the digest
  "rl-determinism|300|export XLA_CLIENT_MEM_FRACTION=0.45; for r in a b; do $RUN $MEDIUM steps=0 warm_start.steps=60 eval_problems=0 checkpoint_every=0 --run-dir runs/det-\$r & done; wait; grep -ho '\"start_policy_sha256\": \"[0-9a-f]*' runs/det-a/results.json runs/det-b/results.json; $PHASES runs/det-a"
  "rl-warm-start-medium|540|$RUN $MEDIUM steps=0 --run-dir runs/ws-medium"
  # the recipe (128 prompts x 8, minibatches of 128 sequences): warm start and 220 RL steps (the
  # run stops itself after RL_MIN minutes, default 9, to fit a call with less device time left;
  # RL_ARGS: more key=value overrides, e.g. RL_ARGS="lr=5e-5 lr_warmup_steps=20")
  "rl-learn-medium|565|$RUN $MEDIUM time_limit_min=\${RL_MIN:-9} checkpoint_every=0 \${RL_ARGS:-} --run-dir runs/learn-bf16; $keep runs/learn-bf16; $PHASES runs/learn-bf16"
  # what a warm start of each length solves greedily (1,024 held-out problems): the recipe's
  # WS for RL to learn (at 320 steps ~8 %, at 560 ~85 %); WS_MAP: the lengths, 4 fit a call
  "rl-warm-start-map|540|for n in \${WS_MAP:-360 400 440 480}; do $RUN $MEDIUM steps=0 warm_start.steps=\$n checkpoint_every=0 --run-dir runs/ws-map-\$n > $OUT/ws-map-\$n.log 2>&1; echo \"warm_start.steps=\$n rc=\$? \$(grep -o '\"eval/reward\": [0-9.]*' runs/ws-map-\$n/metrics.jsonl | tail -1)\"; rm -rf runs/ws-map-\$n/policy; done"
  # the recipe from a shorter warm start of WS steps (more for RL to learn: after 200 steps the
  # policy solves ~4 % greedily, after 560 ~85 %)
  "rl-learn-medium-ws|565|$RUN $MEDIUM warm_start.steps=\${WS:-420} time_limit_min=\${RL_MIN:-9} checkpoint_every=0 \${RL_ARGS:-} --run-dir runs/learn-ws\${WS:-420}; $keep runs/learn-ws\${WS:-420}; $PHASES runs/learn-ws\${WS:-420}"
  # the rollout's row writes (tokens, log-probs, K/V, codes) against NumPy, with and without
  # XLA's deterministic ops, in the form before a851a84 and in scatter_rows (since it, the GPU's
  # mismatch at medium fell ~10x and TRACE's guided sites agree to ~1e-6)
  # (then one rollout per form of a 2-layer random medium model through the Pallas engine under
  # the flag, compared bit for bit: the writes inside the engine's loop)
  "row-writes|420|$PY $BENCH/row_writes.py; $PY $BENCH/row_writes.py --deterministic; $PY $BENCH/row_writes.py --deterministic --engine medium --layers 2 --batch 256"
  # the BF16 trainer-vs-rollout mismatch of the recipe's warm start, by batch (256 or 1,024
  # sequences) and expert matmul (JAX's Hopper kernels or XLA's form) on either side
  "rl-mismatch-bf16|560|$ws_once || exit 1; $PY $BENCH/rl_mismatch.py $MEDIUM $from_ws --prompts 32,128 --json $OUT/rl-mismatch-bf16.json"
  # the same with XLA's decode attention in the engine instead of the Pallas kernel
  "rl-mismatch-bf16-xla|400|$PY $BENCH/rl_mismatch.py $MEDIUM rollout_backend=xla --prompts 128 --json $OUT/rl-mismatch-bf16-xla.json"
  # where TRACE-all's guided sites leave the rollout's codes (0.2-2 % of elements in the RL
  # loop's first steps at `medium`, nearly all two or more steps apart; none on the CPU): one
  # rollout batch per engine (both Pallas kernels, then XLA; then the expert kernel alone), by
  # layer, position and sequence (each engine compiles for ~1 min)
  "rl-guided-mismatch|540|$ws_once || exit 1; $PY $BENCH/guided_mismatch.py $MEDIUM $from_ws experiment=fp4_trace_all code_metrics_rows=64 --prompts 64 --backends pallas,xla --json $OUT/guided-mismatch.json"
  "rl-guided-mismatch-moe|400|$ws_once || exit 1; $PY $BENCH/guided_mismatch.py $MEDIUM $from_ws experiment=fp4_trace_all code_metrics_rows=64 --prompts 64 --backends pallas:moe --json $OUT/guided-mismatch-moe.json"
  # each program's tracing, lowering and compilation seconds in the first RL step of an FP4 mode
  # (QAT: the rollout records every site's codes for 8 sequences; then with no code records); a
  # run stopped at its limit prints its Python stack (SIGABRT, PYTHONFAULTHANDLER)
  "rl-compile-qat|500|export JAX_LOG_COMPILES=1 PYTHONFAULTHANDLER=1; for r in 8 0; do timeout -s ABRT 230 $RUN $MEDIUM experiment=fp4_qat warm_start.steps=2 steps=2 eval_problems=0 checkpoint_every=0 code_metrics_rows=\$r --run-dir runs/compile-qat-\$r > $OUT/compile-qat-\$r.log 2>&1; echo \"code_metrics_rows=\$r rc=\$?\"; grep -o 'Finished .* in [0-9.e-]* sec' $OUT/compile-qat-\$r.log | awk '\$(NF-1) > 2 {print \$(NF-1), \$0}' | sort -g | tail -15; rm -rf runs/compile-qat-\$r/checkpoints runs/compile-qat-\$r/policy; done"
  # the FP4 modes from one warm start (made once per machine: runs/ws-modes), 12 RL steps each
  # under the recipe, two modes a step; each program's compile seconds from JAX_LOG_COMPILES
  # (a mode stopped at its limit prints its Python stack); checkpoints removed (a `medium`
  # run's final one is ~11 GB, the machine's disk ~64 GB); then the phases side by side
  "rl-modes-qat-trace|565|$modes_of fp4_qat fp4_trace"
  "rl-modes-all-naive|565|$modes_of fp4_trace_all fp4_rollout_bf16_train"
  # a study's cells (issue 28): SWEEP (default the modes' sweep), ONLY (a glob of its cells),
  # one after another within RL_MIN minutes (`sweep --budget-min`: the cell under way then stops
  # checkpointed, and the next call continues it while the machine is warm; two cells at once
  # made each twice as slow on an H200, RESULTS.md 2026-12-07); MIN_CELL (minutes, default 1):
  # no new cell starts with fewer left (a call after which the machine goes back: a cut cell is lost with the
  # machine, so leave its minutes to a step after this one); the sweep's records (no
  # parameters) come back in $OUT/study.tgz: untar them here, `python -m experiments archive
  # runs/sweeps/<name> docs/results/sweeps/<name>` (cells of every call merged), then `report`
  # (the call's own report, of the cells on this machine, comes back in $OUT/study-report)
  "study|575|$PY -m experiments sweep \${SWEEP:-configs/sweeps/reasoning_modes.yaml} --only \"\${ONLY:-*}\" --budget-min \${RL_MIN:-8.5} --min-cell-min \${MIN_CELL:-1} > $OUT/study.log 2>&1; echo rc=\$?; tail -25 $OUT/study.log; tar czf $OUT/study.tgz --exclude=checkpoints --exclude=policy --exclude=guidance_spill runs/sweeps; d=runs/sweeps/\$(basename \${SWEEP:-reasoning_modes} .yaml); $PY -m experiments report \$d --out $OUT/study-report > $OUT/study-report.log 2>&1 && grep '^|' $OUT/study-report/report.md | head -12"
  # two BF16 cells of the recipe at once on one GPU (what `sweep --jobs 2` does), 40 steps each:
  # their step times against one alone (1.55 s) say whether a study call should run cells in pairs
  # (memory.plan puts a cell at 33-40 GiB, each process here gets 0.45 of the GPU: 33 GiB of an
  # H100, 59 of an H200: run it on an H200; memory/peak_gib of a cell alone is the real need)
  "rl-parallel|480|$ws_once || exit 1; export XLA_CLIENT_MEM_FRACTION=0.45; for s in 0 1; do timeout 400 $RUN $MEDIUM $from_ws seed=\$s steps=40 eval_problems=0 checkpoint_every=0 --run-dir runs/par-\$s > $OUT/par-\$s.log 2>&1 & done; wait; $PHASES runs/par-0 runs/par-1"
  # trim_padding (the trainer's batch cut to its longest sequence, rounded up to 16 slots) against
  # the full 64 slots, BF16 from the recipe's warm start, 30 steps each: the trainer's seconds
  "rl-trim|480|$ws_once || exit 1; for t in false true; do timeout 220 $RUN $MEDIUM $from_ws trim_padding=\$t steps=30 eval_problems=0 checkpoint_every=0 --run-dir runs/trim-\$t > $OUT/trim-\$t.log 2>&1; echo \"trim_padding=\$t rc=\$?\"; done; $PHASES runs/trim-false runs/trim-true"
  # TRACE's step time against vanilla QAT's on the same warm start (issue 27: at most +5 %), in
  # the study's setting (code metrics on 8 sequences); TRACE with its guidance handed over on
  # the device (the default) and through the host cache
  "rl-overhead-modes|565|$ws_once || exit 1; for e in fp4_qat fp4_trace; do timeout 250 $RUN $MEDIUM experiment=\$e $from_ws steps=10 eval_problems=0 checkpoint_every=0 --run-dir runs/overhead-\$e > $OUT/overhead-\$e.log 2>&1; echo \"\$e rc=\$?\"; done; $PHASES runs/overhead-fp4_qat runs/overhead-fp4_trace"
  # the same for TRACE with its guidance through the host cache (guidance_path=host)
  "rl-overhead-host|300|$ws_once || exit 1; timeout 250 $RUN $MEDIUM experiment=fp4_trace guidance_path=host $from_ws steps=10 eval_problems=0 checkpoint_every=0 --run-dir runs/overhead-host > $OUT/overhead-host.log 2>&1; $PHASES runs/overhead-*"
)

if [ "${1:-}" = "--list" ]; then
  for s in "${STEPS[@]}"; do echo "$s"; done
  exit 0
fi

mkdir -p runs
summary=()
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qx "$name"; then
    continue
  fi
  echo "== $name ($limit s): $cmd"
  start=$(date +%s)
  timeout "$limit" bash -c "$cmd" >"$OUT/$name.log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  tail -n 25 "$OUT/$name.log"
  # The runs' records come back as one archive (the machine's disk does not outlive the call, and
  # the device tool returns at most 8 files); checkpoints stay.
  records=$(find runs \( -name '*.jsonl' -o -name '*.json' -o -name '*.yaml' -o -name '*.png' \
    -o -name '*.txt' -o -name 'report.md' \) -not -path '*/policy/*' -not -path '*/checkpoints/*' -not -path '*/guidance_spill/*' 2>/dev/null)
  [ -n "$records" ] && tar czf "$OUT/runs.tgz" $records
  summary+=("$name rc=$rc ${secs}s: $(tail -n 1 "$OUT/$name.log" | cut -c1-150)")
done
echo
[ "${PACK_CACHE:-1}" = 1 ] && pack_cache
echo "== summary"
for line in "${summary[@]}"; do echo "$line"; done
