#!/usr/bin/env bash
# One call of the device tool's `run` on the H200: restores the tuned matmul and attention
# plans, runs one step of the evaluation, and leaves everything it wrote in $OUT/results.tgz
# (a `run` brings back at most 8 files). Unpack it here with `tar xzf <files_at>/results.tgz`
# and commit before the next call: the device's bench/results is replaced by this checkout's
# each call.
#
# usage (on the device, after `source .gpu/setup.sh`):
#   bash bench/h200_session.sh COMMIT STEP [MINUTES]
# COMMIT: this checkout's short commit (the device's .git is not this checkout's);
# MINUTES: --stop-after for the workloads steps (default 6: a call is at most 10 minutes and
# a started cell runs to its end, W1 train ~3 min);
# STEP:
#   tune            re-tune W1-W5's matmul products (~95 s) and keep the cache
#   tune-whisper    tune (200 s budget) and attention-plans' Whisper part (200 s) in one call
#   conv-sweep      bench/conv_sweep.py (~3 min): the merged stride phases against apart too
#   ab              levers, each off against all on, timed interleaved on the workloads'
#                   programs after 2 s of heat (bench/lever_ab.py, ~6 min): pack (independent
#                   neighbouring dispatches as one) on the five training cells; tiled_norms_apart
#                   (off: tiled groups take the norm as a prologue) on W4 fwd; resident_inputs
#                   (off: inputs uploaded every timed call) on 4 fwd cells, again with the
#                   harness's heat and alternating order
#   attention-plans bench/attention_plans.py --record, Whisper (230 s) then the rest (250 s): lane plans
#                   at the workloads' attention shapes against the automatic rule; the winners
#                   (>= 3%) go into the H200's tuning cache (attention table), copied to
#                   bench/results/tuning_h200/ like tune's; attention/tuned.py stays as the
#                   fallback for GPUs without a cache (no hand rewrite needed)
#   splits          bench/attention_split.py on dq (plans x chunks x chunk prefetch), dkv half
#                   (chunks) and the forward's chunk prefetch, then levers attention_dq_split,
#                   attention_dkv_split and attention_split_prefetch on W4 train (~6 min)
#   splits-short    the dq and dkv half splits at W1's and W2's short sequences (~3 min)
#   strict          the ten headline cells, strict f32, with warm-cache compile times
#   fast            the ten headline cells, fast mode, with warm-cache compile times
#   compile-warm    the warm-cache first calls of the headline cells, strict (--compile-warm:
#                   a priming child per compiling side, then a compile-only one: 30 children,
#                   ~14 min at --jobs 4-6, so split the cells over calls with CASES)
#   matrix          the rest of the matrix, resumable (strict first); compile threads 4 a child
#                   (TORCHINDUCTOR_COMPILE_THREADS) for --overlap-compile's concurrent compiles
#   data-parallel   2 ranks sharing the GPU (the machine's Open MPI), SmolLM2 and ResNet-50
# environment: CASES overrides the headline cells of strict / fast (workloads.py --cases);
# WL_ARGS adds arguments to every workloads.py call (e.g. "--no-warm --modes reduce_overhead")
set -euo pipefail
commit=${1:?usage: h200_session.sh COMMIT STEP [MINUTES]}
step=${2:?usage: h200_session.sh COMMIT STEP [MINUTES]}
minutes=${3:-6}
out=${OUT:?set OUT to the output folder of the device tool}
headline=${CASES:-w1:fwd_seq128,w1:train_seq128,w2:fwd_chunk50,w2:train_chunk50,w3:fwd_b4,w3:train_b4,w4:fwd,w4:train,w5:fwd_small_b2,w5:train_small_b2}
cache=~/.cache/meganeura/tuning
mkdir -p "$cache" bench/results/tuning_h200
# -n: on a warm machine the cache this session recorded (attention-plans) is newer than the
# checkout's copy, which comes back only with that call's results
cp -n bench/results/tuning_h200/*.json "$cache"/ 2>/dev/null || true
stamp=$(mktemp)
log="bench/results/h200_session_${step}.txt"
# the headline cells with warm-cache compile figures too (a compile-only child per compiling
# side on the cold child's caches); the rest of the matrix without
wl=(python bench/workloads.py --machine h200 --commit "$commit" --profile --jobs 3
    --skip-done --stop-after "$minutes" ${WL_ARGS:-})
case "$step" in
  tune)
    python -m meganeura tune --workloads --budget-s 270 | tee bench/results/tune_workloads_h200.txt
    cp "$cache"/*.json bench/results/tuning_h200/ ;;
  tune-whisper)
    # the matmul re-tune (its timing now keeps the GPU under load) and Whisper's attention
    # plans in one call (~8 min)
    python -m meganeura tune --workloads --budget-s 200 | tee bench/results/tune_workloads_h200.txt
    python bench/attention_plans.py --budget-s 200 --record --shapes whisper --whisper-cap 10 \
      --out-name attention_plans_h200_whisper 2>&1 | tail -60 | tee "$log"
    cp "$cache"/*.json bench/results/tuning_h200/ ;;
  conv-sweep)
    python bench/conv_sweep.py --budget-s 170 --machine h200 2>&1 | tee "$log" ;;
  ab)
    python bench/lever_ab.py --machine h200 --out bench/results/lever_ab_h200_pack.json \
      --cases w1:train_seq128,w2:train_chunk50,w3:train_b4,w4:train,w5:train_small_b2 \
      --levers pack 2>&1 | tee "$log"
    python bench/lever_ab.py --machine h200 --out bench/results/lever_ab_h200_norms_apart.json \
      --cases w4:fwd --levers tiled_norms_apart 2>&1 | tee -a "$log"
    python bench/lever_ab.py --machine h200 --out bench/results/lever_ab_h200_resident2.json \
      --cases w3:fwd_b4,w4:fwd,w5:fwd_small_b2,w2:fwd_chunk50 --levers resident_inputs 2>&1 \
      | tee -a "$log" ;;
  attention-plans)
    # Whisper first (W4, the slowest cells, never reached before), then the short shapes
    python bench/attention_plans.py --budget-s 230 --record --shapes whisper --whisper-cap 12 \
      --out-name attention_plans_h200_whisper 2>&1 | tail -60 | tee "$log"
    python bench/attention_plans.py --budget-s 250 --record \
      --shapes smollm2,smolvla_self,smolvla_cross 2>&1 | tail -90 | tee -a "$log"
    cp "$cache"/*.json bench/results/tuning_h200/ ;;
  splits)
    # the key split of the long query gradient (plans x chunks x prefetching chunks) and the
    # forward's chunks prefetching (~3 min), then the levers on W4's training step (~2 min)
    python bench/attention_split.py --modes dq --plans 32x2x16,32x1x8,64x2x16 \
      --chunks 1,2,3,4,6 --prefetch 0,1 --out-name attention_split_h200_dq 2>&1 | tee "$log"
    python bench/attention_split.py --modes dkv --chunks 1,2,3,4,6 \
      --out-name attention_split_h200_dkv 2>&1 | tee -a "$log"
    python bench/attention_split.py --modes fwd --plans 32x1x8,32x2x16 --chunks 1,3 \
      --prefetch 0,1 --out-name attention_split_h200_prefetch 2>&1 | tee -a "$log"
    python bench/lever_ab.py --machine h200 --out bench/results/lever_ab_h200_splits.json \
      --cases w4:train --levers attention_dq_split,attention_dkv_split,attention_split_prefetch \
      2>&1 | tee -a "$log" ;;
  splits-short)
    # the same splits at the short sequences of W1 and W2 (their attention backward is 20% of
    # W2's step), against the lane kernels they run today (~3 min)
    python bench/attention_split.py --modes dkv --shapes smollm2,smolvla_self,smolvla_cross \
      --chunks 0,1,2,4,8 --out-name attention_split_h200_dkv_short 2>&1 | tee "$log"
    python bench/attention_split.py --modes dq --shapes smollm2,smolvla_self \
      --plans 4x16x16,8x4x16,16x2x16,32x1x8 --chunks 1,2,4 --prefetch 0,1 \
      --out-name attention_split_h200_dq_short 2>&1 | tee -a "$log" ;;
  strict)
    "${wl[@]}" --precision strict --cases "$headline" 2>&1 | tee "$log" ;;
  fast)
    "${wl[@]}" --precision fast --cases "$headline" 2>&1 | tee "$log" ;;
  compile-warm)
    python bench/workloads.py --machine h200 --commit "$commit" --jobs 4 --gpu-overlap \
      --compile-warm --precision strict --cases "$headline" --stop-after "$minutes" \
      ${WL_ARGS:-} 2>&1 | tee "$log" ;;
  matrix)
    TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4} "${wl[@]}" --no-warm 2>&1 | tee -a "$log" ;;
  data-parallel)
    MPI4PY_MPIABI=openmpi OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      /usr/bin/orterun --allow-run-as-root --oversubscribe -np 2 -x PATH -x PYTHONPATH \
      -x LD_LIBRARY_PATH -x MPI4PY_MPIABI -x VK_DRIVER_FILES "$(command -v python3)" \
      bench/data_parallel.py --machine h200 --workloads smollm2,resnet50 2>&1 | tee "$log" ;;
  *)
    echo "unknown step $step" >&2; exit 2 ;;
esac
# every file under bench/results and docs written by this call
find bench/results docs -type f -newer "$stamp" -print0 | tar czf "$out/results.tgz" --null -T -
tar tzf "$out/results.tgz"
