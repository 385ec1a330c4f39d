#!/usr/bin/env bash
# The open issues' H200 measurements, in two device calls of < 10 min each (PART=1, then PART=2 while the machine
# is warm). GPU tests first, each file under its own limit with tracebacks; then the benchmarks, JSON into $OUT.
#   PART=1 bash scripts/gpu/measure_all.sh    # GPU tests, trainer vs TRL (issue 4), engine vs transformers (issue 3)
#   PART=2 bash scripts/gpu/measure_all.sh    # prefix grouping (8), overlap modes (7), LoRA vs full (9)
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
  gpu_test t_engine 90 tests/rollout/test_engine_gpu.py
  gpu_test t_kernels 90 tests/kernels
  gpu_test t_trainer 120 tests/trainer/test_trainer_gpu.py tests/trainer/test_lora_trainer_gpu.py
  gpu_test t_async 60 tests/trainer/test_async_trainer_gpu.py tests/rewards/test_reward_model.py
  t b_trainer 150 python3 -m nonstop bench trainer --out "$OUT/trainer.json"
  t b_logprob 40 python3 -m nonstop bench logprob --out "$OUT/logprob.json"
  t b_rollout 100 python3 -m nonstop bench rollout --shapes qwen2.5-0.5b --workloads fixed --out "$OUT/rollout.json"
else
  t b_prefix 200 python3 -m nonstop bench prefix --models qwen2.5-1.5b,qwen3-1.7b --prompt-lens 4096 \
    --response-lens 512 --n 8 --out "$OUT/prefix.json"
  t b_modes 200 python3 -m nonstop bench modes --model qwen2.5-0.5b --prompts 32 --n 8 --steps 6 --warmup 2 \
    --out "$OUT/modes.json"
  t b_lora 150 python3 -m nonstop bench lora --out "$OUT/lora.json"
fi
