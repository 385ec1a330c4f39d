#!/usr/bin/env bash
# One device call: learning parity of sync / one_step_off / async on GSM8K with SmolLM2-135M-Instruct
# (examples/gsm8k_smollm2.yaml, the overlap modes issue). Expects /root/smollm2.gguf (assembled from the parts carried
# in earlier calls) and .data/gsm8k (GSM8K's release files, carried). parity.json is written after every mode, so a
# limit keeps the finished modes; MODES picks a subset for a later call.
#   STEPS=30 MODES=sync,one_step_off,async bash scripts/gpu/parity_gsm8k.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m nonstop data gsm8k --source .data/gsm8k --out /tmp/gsm8k > "$OUT/data.log" 2>&1 || { cat "$OUT/data.log"; exit 1; }
t0=$SECONDS
timeout "${LIMIT:-540}" python3 -m nonstop bench parity --config examples/gsm8k_smollm2.yaml \
  actor_rollout_ref.model.path=/root/smollm2.gguf \
  data.train_files=/tmp/gsm8k/train.parquet data.val_files=/tmp/gsm8k/test.parquet data.val_max_samples=256 \
  trainer.test_freq=10 --steps "${STEPS:-30}" --modes "${MODES:-sync,one_step_off,async}" \
  --mode-override async async_training.max_staleness=2 algorithm.rollout_correction.rollout_is=token \
  --work-dir /tmp/parity --out "$OUT/parity" > "$OUT/parity.log" 2>&1
echo "parity rc=$? $((SECONDS - t0))s"
tail -n 40 "$OUT/parity.log"
