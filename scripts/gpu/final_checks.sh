#!/usr/bin/env bash
# One short device call at the end of a session: the GPU tests of what landed since the last full run, each file
# with its own time limit and failure tracebacks (-x --tb=short), the fused log-prob benchmark and nonstop's side of
# the trainer benchmark. Logs and JSON land in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; grep -E "passed|failed|error|Error|^E |FAILED" "$OUT/$name.log" | tail -n 12; }
t profiling 45 python3 -m pytest -q -x --tb=short -p no:cacheprovider -m gpu tests/profiling/test_gpu.py
t logprob_kernels 45 python3 -m pytest -q -x --tb=short -p no:cacheprovider -m gpu tests/kernels/test_logprob_entropy.py
t bench_logprob 40 python3 -m nonstop bench logprob --out "$OUT/logprob.json"
tail -n 8 "$OUT/bench_logprob.log"
t bench_trainer 50 python3 -m nonstop bench trainer --sides nonstop --out "$OUT/trainer_nonstop.json"
tail -n 6 "$OUT/bench_trainer.log"
t engine 40 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/rollout/test_engine_gpu.py \
  -k "never_waits or multi_step"
t trainer 60 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/trainer/test_trainer_gpu.py \
  tests/trainer/test_lora_trainer_gpu.py tests/trainer/test_async_trainer_gpu.py tests/rewards/test_reward_model.py
