"""The starting reward of a model on the built-in task: what `nonstop/arith`'s difficulty was tuned against.

    python scripts/arith_baseline.py [--prompts 64] [--n 4] [--max-tokens 32] [--split train]

Prints one JSON line per mode (greedy; sampled at temperature 1 with a seed per prompt): mean reward, accuracy,
how many groups of n samples hold different rewards (GRPO's signal) and how many are all wrong.
"""

from __future__ import annotations

import argparse
import json
import time

from nonstop.data.arith import DEFAULT_MAX_OPERAND, arith_rows
from nonstop.rewards.arith import score_arith


def measure(llm, tokenizer, rows, params: list) -> dict:
    from nonstop.models.tokenizer import encode_chat

    start = time.perf_counter()
    outputs = llm.generate([encode_chat(tokenizer, row.prompt) for row in rows], params)
    groups = [
        [score_arith(c.text, row.ground_truth) for c in out.outputs] for row, out in zip(rows, outputs, strict=True)
    ]
    scores = [s for group in groups for s in group]
    completions = [c for out in outputs for c in out.outputs]
    return {
        "prompts": len(rows),
        "samples": len(scores),
        "mean_reward": round(sum(scores) / len(scores), 3),
        "accuracy": round(sum(s == 1.0 for s in scores) / len(scores), 3),
        "groups_with_mixed_rewards": sum(len(set(g)) > 1 for g in groups),
        "groups_all_zero": sum(max(g) == 0.0 for g in groups),
        "truncated": round(sum(c.finish_reason == "length" for c in completions) / len(completions), 2),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--split", default="train", choices=("train", "test"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-operand", type=int, default=DEFAULT_MAX_OPERAND)
    args = parser.parse_args(argv)

    from nonstop.models.loading import load_model
    from nonstop.rollout import LLM, SamplingParams

    model, tokenizer = load_model(args.model)
    llm = LLM(model, tokenizer=tokenizer)
    rows = arith_rows(args.split, max_operand=args.max_operand)[: args.prompts]
    greedy = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens)] * len(rows)
    # A seed per prompt: one shared seed would give every prompt's k-th sample the same noise.
    sampled = [
        SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=1000 + i) for i in range(len(rows))
    ]
    for mode, params in (("greedy", greedy), ("temperature=1", sampled)):
        result = measure(llm, tokenizer, rows, params)
        print(
            json.dumps(
                {
                    "split": args.split,
                    "max_operand": args.max_operand,
                    "max_tokens": args.max_tokens,
                    "mode": mode,
                    **result,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
