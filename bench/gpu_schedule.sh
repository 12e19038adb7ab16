#!/usr/bin/env bash
# GPU figures of rollout scheduling, shared prompt prefill and multi-step launches, in one go
# (~15 min on 1 x H100; steps 1 and 2 took 7.5 min on 2026-11-28, warm-up compiles included):
#
#   MODEL=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf RHYME_JAX_GSM8K_DIR=/path/to/gsm8k \
#     OUT=/tmp/gpu_out bash bench/gpu_schedule.sh
#
# Most telling first, so that a lease cut short loses the least:
# 1. bench/schedule_engine.py, 16 GSM8K prompts x G=8 through 32 slots, fifo /
#    residual+divided (ranked by the upper quartile) / oracle, at MULTI_STEP (default 4) steps
#    per launch, on the first prompt set of OFFSETS (default "16 0": prompts 16-31; on 1 x H100
#    2026-11-28 tail cut 94% in each of 5 repeats, makespan / oracle 0.943, and prompts 0-15
#    95%, 0.975), REPEATS times (default 5: a rollout takes ~3 s, compiling ~2 min; the notes
#    give each repeat's tail cut and their median): wall-clock makespan and tail against the
#    oracle's (the scheduling issue's targets), host ms per decode step by part.
# 1b. the same at 64 slots for the 128 requests (SLOTS_WIDE, default 64; "" skips it), the
#    shape of the simulator's H200-trace scenario: on 1 x H100 2026-11-28 (2 repeats) the tail
#    cut was 72-74% on the wall clock and 85% on the modelled one, the one GPU shape short of
#    the 75% target; REPEATS repeats give its median.
# 1c. step 1b with each of DRAIN (default "cost single"; "" skips it) as --drain_steps: one-step
#    launches once nothing waits, so ends are read, and rows move to smaller buckets, up to
#    two launches sooner. On the CPU at this shape (2026-11-28, 2 repeats each) "single" lifted
#    the wall-clock tail cut from 24% / -5% to 56% / 55% at the same makespan; on a GPU the
#    host's extra passes may show, which "cost" weighs (~3-4 min each).
# 2. bench/bucket_moves.py, the same 16 x 8 requests (prompts 0-15) through 32 slots at
#    MULTI_STEP: the tail's bucket moves always at once against where the cost model says they
#    pay (EngineConfig.bucket_moves), wall clock and blocking reads (~3 min).
# 3. bench/prefill_share.py, 8 GSM8K prompts x G=8 in 64 slots, 256 new tokens: a group's
#    prompt prefilled once and copied to its samples against a prefill per request (~1 min).
# 4. step 1 on the other prompt sets of OFFSETS, then at 1 step per launch on prompts 0-15
#    (~3-4 min each; these were measured on 2026-11-27/28 and are re-checks).
# A lease's call runs at most 10 minutes, about steps 1 and 1b: SKIP_ENGINE=1 runs steps 2-3
# (and the host benches) without the others, in a call of its own; DRAIN="" leaves out 1c.
# With HOST_BENCHES=1 (recorded on 1 x H100 2026-11-27; ~5 min more), then:
# 5. step 1's first run again, one more rollout per policy under cProfile ($OUT/profiles.tgz,
#    with that run's log):
#    which host calls (dispatches, copies, the order's work) take a GPU host's time.
# 6. bench/engine_overhead.py at B=32, float32: the launch and the engine's time per decode
#    step, one plain step per compiled call against MULTI_STEP.
# 7. bench/divided_host.py at 1 and MULTI_STEP steps per launch: the engine's host time per
#    pass with a tiny model (device work negligible), on this machine's host; against the same
#    bench's CPU rows it says whether a GPU host pays more per pass for the same work.
# 8. bench/engine_overhead.py at B=32 again, sampling with top-p 0.95: sampling's filters put
#    one conditional in every step, which XLA:GPU resolves by reading its predicate back to the
#    host mid-call; a bare dispatch near the step's device time shows that sync.
# Each bench appends its table to bench/RESULTS.md; their logs go to $OUT, and a copy of
# RESULTS.md after every step (a run cut short keeps the steps it finished). float32 matmuls
# at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest), as the earlier H100 and H200 rows
# of these benches. A lease brings back at most 8 files from $OUT: this script leaves at most
# 7 (RESULTS.md, engine.log (every schedule_engine run), step 1's sampled lengths as a
# simulator trace (lengths_p<offset>.jsonl, for bench/schedsim.py --trace) and step 1b's
# plain-step warm-up times (step_times_s<slots>.json, for bench/schedsim.py --table h100=...):
# the simulator's figures beside the engine's on the same lengths and step times, as
# bench/RESULTS.md did on the CPU on 2026-11-28; bucket_moves.log, and with HOST_BENCHES
# host_benches.log and profiles.tgz).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to the SmolLM2 GGUF (or an HF checkpoint directory)}"
: "${RHYME_JAX_GSM8K_DIR:?set RHYME_JAX_GSM8K_DIR to the GSM8K data directory}"
OUT=${OUT:-/tmp/gpu_schedule}
K=${MULTI_STEP:-4}
REPEATS=${REPEATS:-5}
NOTE=${NOTE:-"GPU, float32 with JAX_DEFAULT_MATMUL_PRECISION=highest (bench/gpu_schedule.sh)"}
mkdir -p "$OUT"
export JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"
export RHYME_JAX_GSM8K_DIR
keep() { cp bench/RESULTS.md "$OUT/RESULTS.md"; }

schedule_engine() {  # step 1's command; further schedule_engine flags as arguments
  python bench/schedule_engine.py --model "$MODEL" --num_prompts 16 --group_size 8 \
    --max_new_tokens 256 --policies fifo,residual+divided,oracle --compile_threads 8 "$@"
}
engine() {  # engine OFFSET STEPS_PER_LAUNCH [SLOTS [FLAGS...]]: one recorded run of step 1
  local offset=$1 k=$2 slots=${3:-32}
  shift $(( $# < 3 ? $# : 3 ))
  schedule_engine --repeats "$REPEATS" --prompt_offset "$offset" --multi_step "$k" \
    --slots "$slots" --note "$NOTE" "$@" 2>&1 | tee -a "$OUT/engine.log"
  keep
}

read -r -a offsets <<< "${OFFSETS:-16 0}"
if [ "${SKIP_ENGINE:-0}" != 1 ]; then
  engine "${offsets[0]}" "$K" 32 --write_trace "$OUT/lengths_p${offsets[0]}.jsonl"
  if [ -n "${SLOTS_WIDE-64}" ]; then
    engine "${offsets[0]}" "$K" "${SLOTS_WIDE-64}" \
      --write_step_times "$OUT/step_times_s${SLOTS_WIDE-64}.json"
    for drain in ${DRAIN-cost single}; do
      engine "${offsets[0]}" "$K" "${SLOTS_WIDE-64}" --drain_steps "$drain"
    done
  fi
fi
python bench/bucket_moves.py --model "$MODEL" --num_prompts 16 --group_size 8 --slots 32 \
  --max_new_tokens 256 --multi_step "$K" --compile_threads 8 --note "$NOTE" 2>&1 |
  tee "$OUT/bucket_moves.log"
keep
python bench/prefill_share.py --model "$MODEL" --num_prompts 8 --group_size 8 \
  --max_new_tokens 256 --note "$NOTE"
keep
if [ "${SKIP_ENGINE:-0}" != 1 ]; then
  for off in "${offsets[@]:1}"; do
    engine "$off" "$K"
  done
  engine 0 1
fi
if [ "${HOST_BENCHES:-0}" != 1 ]; then
  exit 0
fi
schedule_engine --repeats 1 --multi_step "$K" --slots 32 --profile "$OUT/profile_k$K" --no_append \
  > "$OUT/profile_k$K.log" 2>&1
(cd "$OUT" && tar -czf profiles.tgz "profile_k$K"/ "profile_k$K.log" &&
  rm -r "profile_k$K"/ "profile_k$K.log")
python bench/engine_overhead.py --buckets 32 --budgets 0 --new_tokens 128 --multi_step "$K" \
  --dtype float32 --reps 50 --note "$NOTE" 2>&1 | tee -a "$OUT/host_benches.log"
keep
python bench/divided_host.py --multi_step "1,$K" --rounds 3 --note "$NOTE" 2>&1 |
  tee -a "$OUT/host_benches.log"
keep
python bench/engine_overhead.py --buckets 32 --budgets 0 --new_tokens 64 --top_p 0.95 \
  --dtype float32 --reps 50 --note "$NOTE" 2>&1 | tee -a "$OUT/host_benches.log"
keep
