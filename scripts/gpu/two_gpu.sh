#!/usr/bin/env bash
# Measurements on the 2-GPU H200 machine (nvidia-h200-x2), named steps in the order given; logs packed into
# $OUT/logs.tgz, JSON beside it.
#   STEPS="side scale" bash scripts/gpu/two_gpu.sh
# Steps:
#   side   two single-GPU jobs at once: on GPU 0 `bench cascade` (issue 8), then the prefix-grouping sweep at n = 8;
#          on GPU 1 the GPU tests not yet run alone (cascade kernels and engine, KV sizing, critic, resume, async)
#   scale  issue 6: `bench trainer` (nonstop side) on a Qwen2.5-1.5B shape, 1 GPU with 8 prompts x 8, then
#          torchrun on 2 GPUs with 16 prompts x 8 (the same per-GPU workload)
#   modes  issues 6 and 7: colocated sync (2-rank data parallel) vs split one_step_off / async (1 rollout + 1
#          trainer GPU), long-tailed lengths (`bench modes` under torchrun)
source "$(dirname "$0")/common.sh"
for step in ${STEPS:-side scale}; do case $step in
  side)
    ( export CUDA_VISIBLE_DEVICES=1
      gpu_test t_cascade 70 tests/kernels/test_cascade_decode.py tests/rollout/test_cascade_engine.py
      gpu_test t_engine 60 tests/rollout/test_engine_gpu.py
      gpu_test t_critic 90 tests/trainer/test_trainer_gpu.py -k critic
      gpu_test t_async 110 tests/trainer/test_async_trainer_gpu.py -k overrides1 ) &
    ( export CUDA_VISIBLE_DEVICES=0
      t b_cascade 180 python3 -m nonstop bench cascade --out "$OUT/cascade.json"
      t b_prefix ${PREFIX_LIMIT:-150} python3 -m nonstop bench prefix --models qwen2.5-1.5b,qwen3-1.7b \
        --prompt-lens 4096,2048,8192 --response-lens 512 --n 8 --out "$OUT/prefix.json" ) &
    wait ;;
  scale)
    t b_scale1 160 env CUDA_VISIBLE_DEVICES=0 python3 -m nonstop bench trainer --sides nonstop --shape qwen2.5-1.5b \
      --prompts 8 --n 8 --out "$OUT/scale-1gpu.json"
    t b_scale2 200 torchrun --standalone --nproc-per-node=2 -m nonstop bench trainer --sides nonstop \
      --shape qwen2.5-1.5b --prompts 16 --samples-per-prompt 8 --out "$OUT/scale-2gpu.json" ;;
  modes)
    t b_modes2 ${MODES_LIMIT:-240} torchrun --standalone --nproc-per-node=2 -m nonstop bench modes --model qwen2.5-0.5b \
      --prompts 32 --samples-per-prompt 8 --response-len 2048 --median-response 256 --sigma 1.0 --max-staleness 2 --steps 4 --warmup 1 \
      --modes sync,split:one_step_off,split:async --out "$OUT/modes-2gpu.json" ;;
  *) echo "unknown step $step" ;;
esac; done
pack_logs
