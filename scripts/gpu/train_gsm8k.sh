#!/usr/bin/env bash
# One device call: GRPO on GSM8K with SmolLM2-135M-Instruct (examples/gsm8k_smollm2.yaml) for a fixed number of
# steps, deep profiles on two steps, then `nonstop doctor`. Expects /root/smollm2.gguf (assembled from the parts
# carried in earlier calls) and .data/gsm8k (GSM8K's release files, carried). The run directory stays in /tmp (a
# checkpoint is GBs); metrics, curves, profile summaries and plots go to $OUT/run.tgz, the doctor report to $OUT.
#   STEPS=40 EXTRA="global_profiler.steps=[3,8]" bash scripts/gpu/train_gsm8k.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN=${RUN:-/tmp/runs/gsm8k_smollm2}
python3 -m nonstop data gsm8k --source .data/gsm8k --out /tmp/gsm8k > "$OUT/data.log" 2>&1 || { cat "$OUT/data.log"; exit 1; }
t0=$SECONDS
timeout "${LIMIT:-420}" python3 -m nonstop train examples/gsm8k_smollm2.yaml \
  actor_rollout_ref.model.path=/root/smollm2.gguf \
  data.train_files=/tmp/gsm8k/train.parquet data.val_files=/tmp/gsm8k/test.parquet \
  trainer.total_training_steps="${STEPS:-40}" trainer.save_freq=-1 trainer.default_local_dir="$RUN" \
  trainer.logger=[console,tensorboard] ${EXTRA:-} > "$OUT/train.log" 2>&1
echo "train rc=$? $((SECONDS - t0))s"
tr '\r' '\n' < "$OUT/train.log" | grep -v '^train:' | tail -n 30
python3 -m nonstop doctor "$RUN" > "$OUT/doctor.txt" 2>&1; cat "$OUT/doctor.txt" | head -n 40
python3 -m nonstop doctor "$RUN" --json > "$OUT/doctor.json" 2>/dev/null
# One archive: the device returns a limited number of files. Kernel traces stay behind (tens of MB).
tar czf "$OUT/run.tgz" -C "$(dirname "$RUN")" --exclude='*.trace.json*' "$(basename "$RUN")" && ls -la "$OUT/run.tgz"
