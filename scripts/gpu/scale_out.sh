#!/usr/bin/env bash
# The scale-out issue's runs on the 4- or 8-GPU H200 machine (nvidia-h200-x4 / -x8), named steps in the order given;
# logs packed into $OUT/logs.tgz, JSON and doctor reports beside it. NGPU = the GPUs of the machine (4 or 8).
#   NGPU=8 STEPS="scale" bash scripts/gpu/scale_out.sh;  NGPU=8 STEPS="split 7b" bash scripts/gpu/scale_out.sh
# Steps:
#   scale  trainer.mode=sync, the same per-GPU workload (8 prompts x 8 per GPU, 256-token prompts and responses) on
#          1, 2, 4 (and 8) GPUs, Qwen2.5-1.5B shape (SHAPES= to add qwen2.5-7b): step time, perf/throughput per GPU,
#          timing_s/update_weights; step 4 profiled, so each run's doctor report gives the kernel-busy fraction
#   split  colocated sync vs split async on all NGPU GPUs (NGPU/2 rollout GPUs, and ROLLOUT= the doctor's
#          recommendation from the sync run when given), long-tailed lengths (`bench modes` under torchrun)
#   7b     Qwen2.5-7B GRPO with FSDP2 across NGPU GPUs: peak memory per GPU, step time, the doctor's report
source "$(dirname "$0")/common.sh"
NGPU=${NGPU:-8}
run_trainer() {  # name limit gpus shape prompts [overrides...]
  local name=$1 limit=$2 gpus=$3 shape=$4 prompts=$5; shift 5
  t "$name" "$limit" torchrun --standalone --nproc-per-node="$gpus" -m nonstop bench trainer --sides nonstop \
    --shape "$shape" --prompts "$prompts" --samples-per-prompt 8 --prompt-len 256 --response-len 256 --warmup 2 --steps 3 \
    --work-dir "/tmp/$name" --override "global_profiler.steps=[4]" global_profiler.tool=torch "$@" \
    --out "$OUT/$name.json"
  python3 -m nonstop doctor "/tmp/$name/nonstop_run" > "$OUT/$name-doctor.txt" 2>&1
}
for step in ${STEPS:-scale}; do case $step in
  scale)
    for shape in ${SHAPES:-qwen2.5-1.5b}; do
      for g in 1 2 4 8; do
        [ "$g" -le "$NGPU" ] && run_trainer "scale-$shape-${g}gpu" 150 "$g" "$shape" $((8 * g))
      done
    done ;;
  split)
    for r in $((NGPU / 2)) ${ROLLOUT:-}; do
      t "b_split_r$r" 300 torchrun --standalone --nproc-per-node="$NGPU" -m nonstop bench modes --model qwen2.5-1.5b \
        --prompts $((8 * NGPU)) --samples-per-prompt 8 --response-len 2048 --median-response 256 --sigma 1.0 --max-staleness 2 \
        --steps 4 --warmup 1 --rollout-gpus "$r" --modes sync,split:async --out "$OUT/split-r$r.json"
    done ;;
  7b) run_trainer "qwen7b-${NGPU}gpu" 400 "$NGPU" qwen2.5-7b $((4 * NGPU)) ;;
  *) echo "unknown step $step" ;;
esac; done
pack_logs
