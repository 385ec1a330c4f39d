#!/usr/bin/env bash
# Exact speculative decoding on SmolLM2-135M-Instruct and GSM8K (issue 29). Whole, it runs longer than one device call
# may: split it over two with the SKIP_ switches (the run times of its parts are in the dev log).
#   bash scripts/gpu/spec_gsm8k.sh [MODEL] [DATA_DIR]
# MODEL: the SmolLM2 GGUF (default ~/SmolLM2-135M-Instruct.Q4_1.gguf, joined from its carried parts); DATA_DIR:
# GSM8K's release files, train.jsonl and test.jsonl (default .data/gsm8k, carried).
#   (a) the GPU tests of speculative decoding and of the verify kernel
#   (b) `nonstop bench spec` on the untrained model: T 0.6 / 1.0 x 8 / 64 / 256 sequences (1 / 8 / 32 prompts x 8);
#       with BUDGET_AB=B, the 64-sequence T 0.6 case again with `verify_token_budget` B (bench_budget.json); with
#       VARIANT="key=value ...", that case again with those speculative config keys (bench_variant.json); with
#       TIMELINE=1, a profile of one 64-sequence generation per side (scripts/gpu/spec_timeline.py)
#   (c) a short GRPO run on GSM8K (a lower-entropy checkpoint, as a policy mid-run) and `bench spec` on it at T 1.0
#   (d) sync GRPO steps from that checkpoint with and without speculation, in one run (`nonstop bench spec-steps`):
#       timing_s/gen and timing_s/step per side, paired
# $OUT gets summary.txt, bench_untrained.json, bench_budget.json, bench_variant.json, bench_trained.json,
# samples_trained.json (the checkpoint's plain samples, for offline replays), spec_steps.json, timeline_64.json and logs.tgz
# (every log). Set NONSTOP_GIT_COMMIT to the commit that runs (the device copy's .git is stale).
# SKIP_TESTS=1, SKIP_BENCH=1 (both benches), SKIP_UNTRAINED=1 (the untrained model's bench), SKIP_TRAIN=1 (the checkpoint of an earlier call on this machine),
# SKIP_AB=1 skip parts. STEPS (GRPO steps of (c), default 15), LR (its learning rate, default 1e-5), AB_PAIRS (timed
# pairs of (d), default 4), TEMPS, PROMPTS and REPEATS (of (b), default 0.6,1.0, 1,8,32 and 6), TRAINED_REPEATS
# (default 6) change the sizes, BENCH_LIMIT each bench's time limit (s); SPEC="key=value ..." sets speculative config keys everywhere; AB_FROM=untrained skips (c) and runs (d)
# from MODEL.
source "$(dirname "$0")/common.sh"
MODEL=${1:-$HOME/SmolLM2-135M-Instruct.Q4_1.gguf}
DATA=${2:-.data/gsm8k}
STEPS=${STEPS:-15}
LR=${LR:-1e-5}
AB_PAIRS=${AB_PAIRS:-4}
read -r -a SPEC <<< "${SPEC:-}"
[ -f "$MODEL" ] || { echo "no model at $MODEL"; exit 1; }
python3 -m nonstop data gsm8k --source "$DATA" --out /tmp/gsm8k > "$OUT/data.log" 2>&1 || { cat "$OUT/data.log"; exit 1; }
TRAIN=(python3 -m nonstop train examples/gsm8k_smollm2.yaml data.train_files=/tmp/gsm8k/train.parquet
       data.val_files=/tmp/gsm8k/test.parquet trainer.val_before_train=False trainer.test_freq=-1
       trainer.logger=[console])

[ -n "${SKIP_TESTS:-}" ] || gpu_test tests 360 tests/rollout/test_spec_gpu.py tests/kernels/test_paged_verify.py tests/kernels/test_suffix_match.py tests/kernels/test_verify_round.py

[ -n "${SKIP_BENCH:-}${SKIP_UNTRAINED:-}" ] || t bench_untrained "${BENCH_LIMIT:-300}" python3 -m nonstop bench spec --model "$MODEL" --data "$DATA/train.jsonl" \
  --temperatures "${TEMPS:-0.6,1.0}" --prompts "${PROMPTS:-1,8,32}" --repeats "${REPEATS:-6}" \
  --out "$OUT/bench_untrained.json" ${SPEC[@]:+--spec "${SPEC[@]}"}

[ -z "${BUDGET_AB:-}" ] || t bench_budget 150 python3 -m nonstop bench spec --model "$MODEL" --data "$DATA/train.jsonl" \
  --temperatures 0.6 --prompts 8 --repeats "${REPEATS:-6}" --out "$OUT/bench_budget.json" \
  --spec ${SPEC[@]:+"${SPEC[@]}"} verify_token_budget="$BUDGET_AB"

[ -z "${VARIANT:-}" ] || t bench_variant 150 python3 -m nonstop bench spec --model "$MODEL" --data "$DATA/train.jsonl" \
  --temperatures 0.6 --prompts 8 --repeats "${REPEATS:-6}" --out "$OUT/bench_variant.json" \
  --spec ${SPEC[@]:+"${SPEC[@]}"} $VARIANT

[ -z "${TIMELINE:-}" ] || t timeline 150 python3 scripts/gpu/spec_timeline.py --model "$MODEL" --data "$DATA/train.jsonl" \
  --prompts 8 --out "$OUT/timeline_64.json" ${SPEC[@]:+--spec "${SPEC[@]}"}

RUN=/tmp/runs/spec_train
CKPT=$RUN/checkpoints/global_step_$STEPS/actor
if [ "${AB_FROM:-}" = untrained ]; then
  CKPT=$MODEL
elif [ -z "${SKIP_TRAIN:-}" ]; then
  TRAIN_LIMIT=$((120 + 8 * STEPS)); [ "$TRAIN_LIMIT" -le 450 ] || TRAIN_LIMIT=450  # room for the bench in the same call
  t train "$TRAIN_LIMIT" "${TRAIN[@]}" actor_rollout_ref.model.path="$MODEL" trainer.total_training_steps="$STEPS" \
    trainer.save_freq="$STEPS" trainer.default_local_dir="$RUN" actor_rollout_ref.actor.optim.lr="$LR"
fi
if [ -e "$CKPT" ]; then
  [ "$CKPT" = "$MODEL" ] || [ -n "${SKIP_BENCH:-}" ] || t bench_trained "${BENCH_LIMIT:-200}" python3 -m nonstop bench spec --model "$CKPT" --data "$DATA/train.jsonl" \
    --temperatures 1.0 --prompts 1,8,32 --repeats "${TRAINED_REPEATS:-6}" --out "$OUT/bench_trained.json" \
    --samples "$OUT/samples_trained.json" ${SPEC[@]:+--spec "${SPEC[@]}"}
  [ -n "${SKIP_AB:-}" ] || t spec_steps 240 python3 -m nonstop bench spec-steps examples/gsm8k_smollm2.yaml --pairs "$AB_PAIRS" \
    --out "$OUT/spec_steps.json" data.train_files=/tmp/gsm8k/train.parquet data.val_files=/tmp/gsm8k/test.parquet \
    trainer.logger=[console] actor_rollout_ref.model.path="$CKPT" trainer.default_local_dir=/tmp/runs/spec_steps "${SPEC[@]/#/actor_rollout_ref.rollout.speculative.}"
else
  echo "no checkpoint at $CKPT: (c)'s bench and (d) skipped"
fi

python3 - "$OUT" "$RUN" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out, run = Path(sys.argv[1]), Path(sys.argv[2])


def steps(path):
    rows = [json.loads(line) for line in open(path)] if path.exists() else []
    return [r for r in rows if "timing_s/step" in r]


for name in ("bench_untrained", "bench_budget", "bench_variant", "bench_trained"):
    path = out / f"{name}.json"
    if not path.exists():
        if name not in ("bench_budget", "bench_variant"):  # those run only with BUDGET_AB, VARIANT
            print(f"{name}: missing")
        continue
    print(f"\n{name}: T seqs plain_s spec_s speedup x/len +history_s speedup accept tok/verify verify_frac same"
          " | replayed over plain: priced ceiling round<=1.5 | round/plain")
    rows = json.loads(path.read_text())["rows"]
    for r in rows:
        w, s = r["wall_s"], r["spec"]
        print(f"  {r['temperature']:.1f} {r['sequences']:4d} {w['plain']:.3f} {w['spec']:.3f} {r['speedup']:.2f}x "
              f"{r.get('speedup_per_longest', 0):.2f}x {w['spec_history']:.3f} {r['speedup_history']:.2f}x "
              f"{s.get('spec/acceptance_rate', 0):.2f} {s.get('spec/tokens_per_verify', 0):.2f} "
              f"{s.get('spec/verify_step_frac', 0):.2f} {r['identical_to_plain']:.2f}", end="")
        x, cost = r.get("replay"), r.get("round_over_plain")
        print(f" | {x['token_speedup']:.2f}x {x['free_speedup']:.2f}x {x['break_even_round']:.3f}" if x else " |", end="")
        print(f" | {cost:.3f}" if cost is not None else " | -")
    for r in rows:  # where the time went, summed over the timed repeats: steps / seconds by launch kind
        for side in ("plain", "spec"):
            runs = r.get("steps", {}).get(side, [])
            kinds = {}
            for b in runs:
                for k, v in b["kinds"].items():
                    kinds.setdefault(k, [0, 0.0])
                    kinds[k][0] += v["steps"]
                    kinds[k][1] += v["s"]
            print(f"  {r['temperature']:.1f} {r['sequences']:4d} {side:>5} longest "
                  f"{[b['longest'] for b in runs]} outside {sum(b['outside_s'] for b in runs):.3f} " +
                  " ".join(f"{k} {n}/{t:.3f}" for k, (n, t) in sorted(kinds.items())))
trained = steps(run / "metrics.jsonl")
if trained:
    print(f"\ntraining: {len(trained)} steps, actor/entropy {trained[0].get('actor/entropy')} -> "
          f"{trained[-1].get('actor/entropy')}, response_length/mean {trained[0].get('response_length/mean')} -> "
          f"{trained[-1].get('response_length/mean')}")
path = out / "spec_steps.json"
if path.exists():
    r = json.loads(path.read_text())["result"]
    p, s = r["plain"], r["spec"]
    print(f"\nsync GRPO steps, one run (median of {p['steps']} + {s['steps']} steps after the warm-up): gen "
          f"{p['timing_s/gen']:.2f} s -> {s['timing_s/gen']:.2f} s, step {p['timing_s/step']:.2f} s -> "
          f"{s['timing_s/step']:.2f} s; paired: gen {r['gen_speedup']:.2f}x, step {r['step_speedup']:.2f}x "
          f"(pairs without a graph capture: gen {r['gen_speedup_without_captures'] or 0:.2f}x); spec "
          f"tokens/verify {s.get('rollout/spec/tokens_per_verify', 0):.2f}, acceptance "
          f"{s.get('rollout/spec/acceptance_rate', 0):.2f}, verify share {s.get('rollout/spec/verify_step_frac', 0):.2f}")
EOF
pack_logs
ls -la "$OUT"
