#!/usr/bin/env bash
# One device call: `nonstop bench trl-parity` for one task on the H200 -- 3 seeds x (nonstop, TRL) as six processes
# at once on the one GPU, then one timing run per side alone -- within BUDGET seconds; the result directory packed
# into $OUT/trl_parity.tgz, the plot and JSON beside it, the table printed.
#   TASK=arith bash scripts/gpu/trl_parity.sh
#   TASK=gsm8k bash scripts/gpu/trl_parity.sh     # needs .data/gsm8k (GSM8K's release files, carried)
# Expects /root/smollm2.gguf (assembled from the parts carried in earlier calls; MODEL overrides) and the carried
# wheels in .whl (trl, datasets, gguf, ...). Sizes (override any by name):
#   arith  40 steps of 16 prompts x 8 samples, 32-token responses, validation at 0/20/40 (31 problems), timing
#          runs of all 40 steps: TRL's generation is a per-token host loop, so a TRL step costs about the same at
#          128 samples as at 32, while 4x the samples per step smooths the curves
#   gsm8k  20 steps of 32 prompts x 8 samples, 256-token responses (SmolLM2 answers in ~220), validation at 0/20
#          on 128 test problems, the format reward (examples/gsm8k_reward.py); timing runs of 4 steps
source "$(dirname "$0")/common.sh"
TASK=${TASK:-arith}
MODEL=${MODEL:-/root/smollm2.gguf}
case $TASK in
  arith) defaults=(40 16 8 32 20 40 "") ;;
  gsm8k) defaults=(20 32 8 256 20 4 "--gsm8k-dir .data/gsm8k --val-size 128 --trl-micro-batch 64") ;;
  *) echo "TASK must be arith or gsm8k, got $TASK"; exit 2 ;;
esac
STEPS=${STEPS:-${defaults[0]}} PROMPTS=${PROMPTS:-${defaults[1]}} N=${N:-${defaults[2]}}
RESPONSE_LEN=${RESPONSE_LEN:-${defaults[3]}} TEST_FREQ=${TEST_FREQ:-${defaults[4]}} ALONE=${ALONE:-${defaults[5]}}
BUDGET=${BUDGET:-480}
RES=$OUT/trl-parity-$TASK
t0=$SECONDS
timeout $((BUDGET + 45)) python3 -m nonstop bench trl-parity --task "$TASK" --model "$MODEL" --seeds 0,1,2 \
  --steps "$STEPS" --prompts "$PROMPTS" --n "$N" --response-len "$RESPONSE_LEN" --test-freq "$TEST_FREQ" \
  --jobs 6 --alone-steps "$ALONE" --budget-s "$BUDGET" ${defaults[6]} ${EXTRA:-} \
  --work-dir /tmp/trl-parity-$TASK --out "$RES" > "$OUT/trl_parity.log" 2>&1
echo "trl-parity $TASK rc=$? $((SECONDS - t0))s"
grep -vE "^\{|Warning|warn" "$OUT/trl_parity.log" | tail -n 60
cp "$RES/trl_parity.png" "$RES/trl_parity.json" "$OUT/" 2>/dev/null
tar -czf "$OUT/trl_parity.tgz" -C "$OUT" "trl-parity-$TASK" trl_parity.log && rm -rf "$RES" "$OUT/trl_parity.log"
