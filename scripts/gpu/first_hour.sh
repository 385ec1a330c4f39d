#!/usr/bin/env bash
# Issue 26's H200 runs in one device call on one H200 (limits 60 + 120 + 120 + 90 s): nonstop's GRPO step on a
# random-weight model of Qwen2.5-0.5B's shape (`nonstop bench trainer --sides nonstop`), with a new user's defaults.
#   bash scripts/gpu/first_hour.sh
# Runs (8 prompts x 8 samples, 256-token responses forced to full length):
#   mem2048, mem4096  2,048- and 4,096-token prompts, default micro-batching (nothing set: the token budget is sized
#                     from free memory), prefix grouping off; the "grouped" variant the same with grouping on. Each must
#                     finish; the budget and the out-of-memory retries are printed (actor/micro_batch_token_budget,
#                     actor/oom_retries) and their start-up line is in the log.
#   slow_reward    default settings, a reward function that sleeps 0.25 s a sample (64 samples a step): the issue
#                  asks timing_s/reward <= 15% of timing_s/step.
# First the CUDA test of the sized budget (tests/trainer/test_actor_oom.py: probe measured, gradients equal one
# micro-batch's). The last lines are a table of every run: step time, micro-batches, budget, retries, reward share.
# SHAPE, LENS and RESP change the shape, prompt lengths and response length (a CPU dry run of the script itself:
# SHAPE=smollm2-135m LENS=16 RESP=8). SLOW_ONLY=1 runs the slow reward alone; SLOW_LONGTAIL=1 adds it on long-tailed
# response lengths (the bench's `longtail`: responses end through the generation phase, as with a real policy);
# SLOW_OVERLAP=1 runs each slow-reward run in trainer.mode=one_step_off as well (a variant in the same run).
source "$(dirname "$0")/common.sh"
LENS=${LENS:-2048 4096}
BENCH="python3 -m nonstop bench trainer --sides nonstop --shape ${SHAPE:-qwen2.5-0.5b} --prompts 8 --n 8
  --response-len ${RESP:-256}"
cat > /tmp/slow_reward.py <<'EOF'
"""A reward that takes 0.25 s a sample (issue 26's slow scorer)."""

import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep(0.25)
    return (len(solution_str) % 7) / 7
EOF
[ -n "${SLOW_ONLY:-}" ] && LENS=""
[ -n "$LENS" ] && gpu_test t_oom 60 tests/trainer/test_actor_oom.py
for len in $LENS; do
  t "mem$len" 120 $BENCH --prompt-len "$len" --warmup 1 --steps 2 --work-dir "/tmp/fh_mem$len" \
    --override actor_rollout_ref.actor.use_prefix_grouper=False \
    --variant grouped actor_rollout_ref.actor.use_prefix_grouper=True --out "$OUT/mem$len.json"
  grep -E "micro-batch token budget|out of memory" "$OUT/mem$len.log" | sort | uniq -c | head -n 6
done
overlap=()  # SLOW_OVERLAP=1: the same runs in one_step_off too (scoring beside the next step's generation)
[ -n "${SLOW_OVERLAP:-}" ] && overlap=(--variant one_step_off trainer.mode=one_step_off)
t slow_reward 120 $BENCH --prompt-len "${SLOW_PROMPT_LEN:-128}" --warmup 1 --steps 3 --work-dir /tmp/fh_slow \
  --override custom_reward_function.path=/tmp/slow_reward.py "${overlap[@]}" --out "$OUT/slow_reward.json"
[ -n "${SLOW_LONGTAIL:-}" ] && t slow_reward_longtail 120 $BENCH --prompt-len "${SLOW_PROMPT_LEN:-128}" \
  --warmup 1 --steps 3 --response-lengths longtail --work-dir /tmp/fh_slow_lt \
  --override custom_reward_function.path=/tmp/slow_reward.py "${overlap[@]}" --out "$OUT/slow_reward_longtail.json"
python3 - "$OUT" $LENS <<'EOF'
import json, sys
from pathlib import Path

print(f"\n{'run':22} {'step s':>7} {'micro':>6} {'budget':>8} {'oom':>4} {'reward s':>9} {'reward %':>9}")
for name in [*(f"mem{n}" for n in sys.argv[2:]), "slow_reward", "slow_reward_longtail"]:
    path = Path(sys.argv[1]) / f"{name}.json"
    if not path.is_file():
        print(f"{name:22} no result (see {name}.log)")
        continue
    result = json.loads(path.read_text())
    variants = [(f"{name}+{v}", s) for v, s in result.get("variants", {}).items()]
    for label, side in [(name, result.get("nonstop")), *variants]:
        if side is None or "error" in side:
            print(f"{label:22} failed: {(side or {}).get('error')}")
            continue
        m = side["metrics"]
        reward, step = m.get("timing_s/reward", 0.0), m.get("timing_s/step", side["step_s"])
        print(f"{label:22} {side['step_s']:7.2f} {m.get('actor/num_micro_batches', 0):6.0f} "
              f"{m.get('actor/micro_batch_token_budget', 0):8.0f} {m.get('actor/oom_retries', 0):4.0f} "
              f"{reward:9.2f} {100 * reward / step:8.1f}%")
EOF
