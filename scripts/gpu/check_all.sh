#!/usr/bin/env bash
# One device call: GPU tests, the bf16 parity probe, the decode-attention and rollout benchmarks.
# Run from the repo root on the GPU machine with .whl carried; logs and JSON land in $OUT.
#   STEPS="pytest_gpu bench_rollout" ROLLOUT_ARGS="--shapes qwen2.5-0.5b --workloads fixed" bash scripts/gpu/check_all.sh
#   STEPS="pytest_sel bench_trainer bench_phases" PYTEST_ARGS="tests/trainer" bash scripts/gpu/check_all.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-pytest_gpu bf16_probe bench_decode bench_rollout}
step() { local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"; echo "=== $name rc=$rc $((SECONDS - t0))s"; }
step pytest_gpu "${PYTEST_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu tests
step pytest_sel "${PYTEST_LIMIT:-240}" python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu ${PYTEST_ARGS:-tests}
step bf16_probe 90 python3 scripts/gpu/bf16_parity_probe.py
step bench_decode 150 python3 -m nonstop bench decode-attention --out "$OUT/decode_attention.json"
step bench_rollout "${ROLLOUT_LIMIT:-300}" python3 -m nonstop bench rollout \
  ${ROLLOUT_ARGS:---shapes qwen2.5-0.5b --workloads fixed} --out "$OUT/rollout.json"
step bench_trainer "${TRAINER_LIMIT:-300}" python3 -m nonstop bench trainer ${TRAINER_ARGS:-} --out "$OUT/trainer.json"
step bench_trainer_nonstop "${TRAINER_LIMIT:-300}" python3 -m nonstop bench trainer --sides nonstop ${TRAINER_NONSTOP_ARGS:-} \
  --out "$OUT/trainer_nonstop.json"
step bench_phases 120 python3 -m nonstop bench phases --out "$OUT/phases.json"
step bench_phases_real 120 python3 -m nonstop bench phases --work-us 50000 --repeats 20 --warmup 3 \
  --out "$OUT/phases_real.json"
step bench_prefix "${PREFIX_LIMIT:-200}" python3 -m nonstop bench prefix ${PREFIX_ARGS:-} --out "$OUT/prefix.json"
step bench_modes "${MODES_LIMIT:-200}" python3 -m nonstop bench modes ${MODES_ARGS:-} --out "$OUT/modes.json"
