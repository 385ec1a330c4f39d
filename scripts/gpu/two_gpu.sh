#!/usr/bin/env bash
# Measurements on the 2-GPU H200 machine (nvidia-h200-x2), named steps in the order given; logs packed into
# $OUT/logs.tgz, JSON beside it.
#   STEPS="side scale" bash scripts/gpu/two_gpu.sh
# Steps:
#   side   two single-GPU jobs at once: on GPU 0 `bench cascade` (issue 8), then the prefix-grouping sweep at n = 8;
#          on GPU 1 the GPU tests not yet run alone (cascade kernels and engine, KV sizing, critic, resume, async)
#   scale  issue 6: `bench trainer` (nonstop side) on a Qwen2.5-1.5B shape, 1 GPU with 8 prompts x 8, then
#          torchrun on 2 GPUs with 16 prompts x 8 (the same per-GPU workload)
#   modes  issue 7: split placement vs colocated sync on both GPUs (`bench modes` under torchrun)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; grep -E "passed|failed|^E |FAILED|PROBLEM|speedup|x$" "$OUT/$name.log" | tail -n 8; }
gpu_test() { local name=$1 limit=$2; shift 2
  t "$name" "$limit" python3 -m pytest -v -x --tb=short --durations=5 -p no:cacheprovider -m gpu "$@"; }
for step in ${STEPS:-side scale}; do case $step in
  side)
    ( export CUDA_VISIBLE_DEVICES=1
      gpu_test t_cascade 120 tests/kernels/test_cascade_decode.py tests/rollout/test_cascade_engine.py
      gpu_test t_engine 90 tests/rollout/test_engine_gpu.py
      gpu_test t_critic 120 tests/trainer/test_trainer_gpu.py -k "critic or resume or autocast"
      gpu_test t_async 120 tests/trainer/test_async_trainer_gpu.py -k overrides1 ) &
    ( export CUDA_VISIBLE_DEVICES=0
      t b_cascade 200 python3 -m nonstop bench cascade --out "$OUT/cascade.json"
      t b_prefix ${PREFIX_LIMIT:-220} python3 -m nonstop bench prefix --models qwen2.5-1.5b,qwen3-1.7b \
        --prompt-lens 4096,2048,8192 --response-lens 512 --n 8 --out "$OUT/prefix.json" ) &
    wait ;;
  scale)
    t b_scale1 150 env CUDA_VISIBLE_DEVICES=0 python3 -m nonstop bench trainer --sides nonstop --shape qwen2.5-1.5b \
      --prompts 8 --n 8 --out "$OUT/scale-1gpu.json"
    t b_scale2 180 torchrun --standalone --nproc-per-node=2 -m nonstop bench trainer --sides nonstop \
      --shape qwen2.5-1.5b --prompts 16 --n 8 --out "$OUT/scale-2gpu.json" ;;
  modes) t b_modes2 ${MODES_LIMIT:-300} bash -c "${MODES_CMD:?set MODES_CMD}" ;;
  *) echo "unknown step $step" ;;
esac; done
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
