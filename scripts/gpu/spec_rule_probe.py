"""Why does `draft_rule=auto` verify so rarely on the GPU? (issue 29)

SmolLM2 on GSM8K training prompts, 1 prompt x 8 samples, 384 tokens, T 0.6, three rounds per engine: for the default
engine (auto) and `draft_rule=always`, how often a step was in the drafting range, asked for drafts, got any, and
verified; the rule's state after each round (cost ratio, verify and plain step times, global gain); wall time against
plain decoding (speculation off) on the same engine. With a third argument `k1`, the same with one decode step a
launch.
    python3 scripts/gpu/spec_rule_probe.py MODEL.gguf GSM8K_TRAIN.jsonl [k1]
"""

import collections
import sys
import time

import torch

from nonstop.bench.spec import gsm8k_prompts
from nonstop.rollout import LLM, SamplingParams


def counted(spec, counts):
    wants, propose = spec.wants_drafts, spec.propose

    def wants_drafts(scheduler):
        result = wants(scheduler)
        counts["in_range"] += spec.in_range(scheduler)
        counts["wants"] += result
        return result

    def proposed(scheduler, group_of):
        drafts, seconds = propose(scheduler, group_of)
        counts["proposed"] += 1
        counts["verify"] += drafts is not None
        counts["draft_tokens_if_verified"] += sum(map(len, (drafts or {}).values()))
        return drafts, seconds

    spec.wants_drafts, spec.propose = wants_drafts, proposed


def timed(llm, prompts, params):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(c.token_ids) for o in out for c in o.outputs)


def main():
    model, data = sys.argv[1], sys.argv[2]
    cases = [("auto", None), ("always", None)] + ([("auto", 1), ("always", 1)] if sys.argv[3:] == ["k1"] else [])
    for rule, steps in cases:
        kwargs = {} if steps is None else {"num_scheduler_steps": steps}
        llm = LLM(model, max_num_seqs=64, gpu_memory_utilization=0.5,
                  speculative_config={"method": "suffix", "draft_rule": rule}, **kwargs)  # fmt: skip
        engine = llm.llm_engine
        spec = engine.speculator
        counts = collections.Counter()
        counted(spec, counts)
        prompts = gsm8k_prompts(llm.tokenizer, data, 1)
        for round_ in range(3):
            params = SamplingParams(n=8, temperature=0.6, max_tokens=384, seed=round_)
            engine.speculator = None
            plain_s, plain_tokens = timed(llm, prompts, params)
            engine.speculator = spec
            spec.drafter.history.responses.clear()
            counts.clear()
            before = engine.scheduler.stats.num_verify_steps
            spec_s, spec_tokens = timed(llm, prompts, params)
            p = spec.policy
            print(
                f"{rule:6s} k={steps or 'default'} round {round_}: plain {plain_s:.3f}s ({plain_tokens} tok) spec "
                f"{spec_s:.3f}s ({spec_tokens} tok) {plain_s / spec_s:.2f}x | {dict(counts)} | verify steps "
                f"{engine.scheduler.stats.num_verify_steps - before} | ratio {p.cost_ratio()} gain "
                f"{p.global_gain:.2f} verify_ms {[round(1e3 * x, 2) for x in p.verify_times]} plain_ms "
                f"{[round(1e3 * x, 3) for x in p.plain_times]}",
                flush=True,
            )
        print({k: v for k, v in llm.metrics.items() if "spec" in k}, flush=True)
        del llm, engine, spec
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
