"""The untrained model's expected reward on a trl-parity work directory's first arith step, sampled by nonstop's
engine and by `transformers.generate` (T 1, no top-k / top-p), several seeds each, fp32 on the CPU: whether the two
sample the same distribution (the first step of `nonstop bench trl-parity` compares nonstop with TRL there).
    python scripts/arith_step1_sampling.py WORK_DIR [SEEDS]
WORK_DIR is a `nonstop bench trl-parity --task arith --work-dir` directory (its `model/` and seed 0's prompt file).
"""

import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nonstop.rewards.arith import score_arith
from nonstop.rollout import LLM, SamplingParams

N, MAX_TOKENS, PROMPTS = 8, 32, 16


def main() -> None:
    work, seeds = Path(sys.argv[1]), range(int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    rows = [json.loads(line) for line in open(work / "data" / "train-seed0.jsonl")][:PROMPTS]
    model_dir = str(work / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    chats = [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True) for r in rows
    ]
    prompts = [list(c["input_ids"]) for c in chats]
    truths = [r["reward_model"]["ground_truth"] for r in rows]

    def mean_score(texts: list[list[str]]) -> float:
        return statistics.fmean(score_arith(t, g) for ts, g in zip(texts, truths, strict=True) for t in ts)

    llm = LLM(model_dir, device="cpu")
    engine = []
    for seed in seeds:
        out = llm.generate(prompts, SamplingParams(n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=seed))
        engine.append(mean_score([[tok.decode(c.token_ids, skip_special_tokens=True) for c in o.outputs] for o in out]))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf = []
    for seed in seeds:
        torch.manual_seed(seed)
        texts = []
        for p in prompts:
            with torch.no_grad():
                ids = model.generate(torch.tensor([p] * N), attention_mask=torch.ones(N, len(p), dtype=torch.long),
                                     do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=MAX_TOKENS,
                                     eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id)  # fmt: skip
            texts.append([tok.decode(x[len(p) :], skip_special_tokens=True) for x in ids])
        hf.append(mean_score(texts))
    for name, values in (("nonstop engine", engine), ("transformers.generate", hf)):
        print(
            f"{name}: {statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} over {len(values)} seeds "
            f"({', '.join(f'{v:.3f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
