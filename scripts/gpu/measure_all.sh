#!/usr/bin/env bash
# The open issues' H200 measurements, in device calls of < 10 min each (PART=1, 2, 3 while the machine is warm).
# GPU tests first, each file under its own limit with tracebacks; then the benchmarks, JSON into $OUT.
#   PART=1 [BASE_SRC=.base/src] bash scripts/gpu/measure_all.sh  # GPU tests; engine vs transformers (3), A/B vs BASE_SRC
#   PART=2 bash scripts/gpu/measure_all.sh    # trainer vs TRL (4), fused log-prob, overlap modes (7), LoRA vs full (9)
#   PART=3 bash scripts/gpu/measure_all.sh    # prefix grouping sweep (8)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; grep -E "passed|failed|^E |FAILED|faster|tok/s|x the" "$OUT/$name.log" | tail -n 8; }
gpu_test() { local name=$1 limit=$2; shift 2; t "$name" "$limit" python3 -m pytest -q -x --tb=short -p no:cacheprovider -m gpu "$@"; }
if [ "${PART:-1}" = 1 ]; then
  gpu_test t_profiling 40 tests/profiling/test_gpu.py
  gpu_test t_engine 100 tests/rollout/test_engine_gpu.py
  gpu_test t_kernels 90 tests/kernels tests/models/test_transformer_gpu.py
  gpu_test t_trainer 120 tests/trainer/test_trainer_gpu.py tests/trainer/test_lora_trainer_gpu.py
  gpu_test t_async 60 tests/trainer/test_async_trainer_gpu.py tests/rewards/test_reward_model.py
  # A/B of the engine: BASE_SRC (another commit's src/, e.g. `git archive <rev> src | tar -x -C .base`) vs this tree
  if [ -n "${BASE_SRC:-}" ]; then
    t b_rollout_base 100 env PYTHONPATH=/tmp/site:$PWD/$BASE_SRC python3 -m nonstop bench rollout --shapes qwen2.5-0.5b \
      --workloads fixed --out "$OUT/rollout-base.json"
  fi
  t b_rollout 100 python3 -m nonstop bench rollout --shapes qwen2.5-0.5b --workloads fixed --out "$OUT/rollout.json"
elif [ "$PART" = 2 ]; then
  t b_trainer 150 python3 -m nonstop bench trainer --out "$OUT/trainer.json"
  t b_logprob 40 python3 -m nonstop bench logprob --out "$OUT/logprob.json"
  t b_modes 200 python3 -m nonstop bench modes --model qwen2.5-0.5b --prompts 32 --n 8 --steps 6 --warmup 2 \
    --out "$OUT/modes.json"
  t b_lora 150 python3 -m nonstop bench lora --out "$OUT/lora.json"
else
  t b_prefix 500 python3 -m nonstop bench prefix --models qwen2.5-1.5b,qwen3-1.7b --prompt-lens 2048,4096,8192 \
    --response-lens 512 --n 4,8,16 --out "$OUT/prefix.json"
fi
