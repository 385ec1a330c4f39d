"""Where do the bf16 speculative engine's log-probs part from a bf16 full forward? (issue 29)

The workload of `test_bf16_speculative_logprobs_match_a_full_forward`, each variant's mean and max abs difference
from the packed bf16 forward, and for the speculative runs the same split by where a token came from: a plain decode
step, slot 0 of a verify step (the row's last token: what decode computes) or slot j >= 1 (after accepted drafts).
Variants swap one piece at a time: graphs off, the Triton verify kernel for the plain-PyTorch reference, the fused
rotary-and-cache kernel for its two torch steps. `--dtype float32` runs the same against an fp32 forward (a real bug
shows there too; rounding does not).
    PYTHONPATH=src:tests/rollout python3 scripts/gpu/spec_logprob_probe.py [--dtype float32]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "tests" / "rollout")]

from rollout_helpers import random_prompts  # noqa: E402
from spec_helpers import PartlyWrongDrafter, speculative_llm  # noqa: E402
from test_engine_gpu import LENGTHS, MEDIUM, cuda_model  # noqa: E402

import nonstop.kernels.rotary_cache as rotary_cache  # noqa: E402
import nonstop.rollout.paged_attention as paged_attention  # noqa: E402
from nonstop.kernels.paged_verify import paged_verify_attention_reference  # noqa: E402
from nonstop.models import PackedAttention, packed_positions  # noqa: E402
from nonstop.rollout import LLM, SamplingParams  # noqa: E402

V = MEDIUM["vocab_size"]


class RecordingDrafter(PartlyWrongDrafter):
    """Also records which prompt each draft was for, so each output position maps to its verify slot."""

    def propose(self, seqs, groups, num_tokens):
        drafts = super().propose(seqs, groups, num_tokens)
        self.where = getattr(self, "where", [])
        self.where += [(tuple(s.prompt_token_ids), s.sample_index, s.num_output_tokens, len(d))
                       for s, d in zip(seqs, drafts, strict=True)]  # fmt: skip
        return drafts


def forward_logprobs(model, truth_model, prompts, outputs):
    """Per sample: |engine - packed forward in the model's dtype| and |engine - transformers in fp32| per token, and
    the packed forward's own |packed - fp32|."""
    seqs = [(p, c) for p, o in zip(prompts, outputs, strict=True) for c in o.outputs]
    lengths = [len(p) + len(c.token_ids) for p, c in seqs]
    with torch.no_grad():
        ids = torch.tensor([t for p, c in seqs for t in p + c.token_ids], device="cuda")
        h = model(ids, packed_positions(lengths, "cuda"), PackedAttention.from_lengths(lengths, "cuda"))
        logprobs = model.compute_logits(h).float().log_softmax(-1)
    rows, offset = [], 0
    for (prompt, c), length in zip(seqs, lengths, strict=True):
        tokens = torch.tensor(c.token_ids, device="cuda")
        pos = torch.arange(offset + len(prompt) - 1, offset + length - 1, device="cuda")
        packed = logprobs[pos, tokens].cpu()
        with torch.no_grad():
            full = truth_model(input_ids=torch.tensor([prompt + c.token_ids], device="cuda")).logits[0]
        truth = full.float().log_softmax(-1)[torch.arange(len(prompt) - 1, length - 1, device="cuda"), tokens].cpu()
        engine = torch.tensor(c.logprobs)
        rows.append(((tuple(prompt), c.index), (engine - packed).abs(), (engine - truth).abs(), (packed - truth).abs()))
        offset += length
    return rows


def slots(drafter, key, num_tokens):
    """Per output position: -1 plain decode, else its verify slot."""
    out = [-1] * num_tokens
    for prompt, index, start, _ in getattr(drafter, "where", []):
        if (prompt, index) == key:
            for j in range(num_tokens - start):
                out[start + j] = j
    return out


def report(name, rows, drafter=None):
    diff, err, packed_err = (torch.cat([r[i] for r in rows]) for i in (1, 2, 3))
    line = (
        f"{name:38s} vs packed {diff.mean():.4f} / max {diff.max():.4f}; vs fp32 {err.mean():.4f} / max "
        f"{err.max():.4f} (packed vs fp32 {packed_err.mean():.4f} / {packed_err.max():.4f}; {diff.numel()} tokens)"
    )
    if drafter is not None:
        by = {"plain": [], "slot0": [], "slot1+": []}
        for key, d, _, _ in rows:
            for s, x in zip(slots(drafter, key, len(d)), d.tolist(), strict=True):
                by["plain" if s < 0 else "slot0" if s == 0 else "slot1+"].append(x)
        line += "\n    vs packed by source: " + "  ".join(
            f"{k} {sum(v) / max(len(v), 1):.4f} (n={len(v)})" for k, v in by.items()
        )
    print(line, flush=True)


def unfused_rotary_and_cache(*args):
    saved = rotary_cache.use_fused_kernel
    rotary_cache.use_fused_kernel = lambda *_: False
    try:
        return rotary_cache.rotary_and_cache(*args)
    finally:
        rotary_cache.use_fused_kernel = saved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    dtype = getattr(torch, parser.parse_args().dtype)
    print(f"--- {dtype}")
    reference, model = cuda_model(dtype=dtype)
    truth = reference.float()
    prompts = random_prompts(LENGTHS, vocab=V)[:4]
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=32, seed=3)
    plain = LLM(model, num_kv_blocks=256, max_num_seqs=40).generate(prompts, params)
    report("plain (graphs)", forward_logprobs(model, truth, prompts, plain))
    eager = LLM(model, num_kv_blocks=256, max_num_seqs=40, enforce_eager=True).generate(prompts, params)
    report("plain (eager)", forward_logprobs(model, truth, prompts, eager))
    k1 = LLM(model, num_kv_blocks=256, max_num_seqs=40, num_scheduler_steps=1).generate(prompts, params)
    report("plain (1 step a launch)", forward_logprobs(model, truth, prompts, k1))
    reference_verify = {"paged_verify_attention": paged_verify_attention_reference}
    for name, kwargs, patch in [
        ("spec (graphs)", {}, {}),
        ("spec (eager)", {"enforce_eager": True}, {}),
        ("spec (eager, reference verify)", {"enforce_eager": True}, reference_verify),
        ("spec (eager, unfused rotary)", {"enforce_eager": True}, {"rotary_and_cache": unfused_rotary_and_cache}),
        ("spec (graphs, wrong_every=1)", {"wrong_every": 1}, {}),
        ("spec (graphs, exact drafts)", {"wrong_every": 0}, {}),
        ("spec (graphs, exact, 1 token)", {"wrong_every": 0, "num_speculative_tokens": 1}, {}),
        ("spec (eager, exact, reference verify)", {"wrong_every": 0, "enforce_eager": True}, reference_verify),
    ]:
        drafter = RecordingDrafter.from_outputs(prompts, plain, V, wrong_every=kwargs.pop("wrong_every", 3))
        saved = {key: getattr(paged_attention, key) for key in patch}
        for key, value in patch.items():
            setattr(paged_attention, key, value)
        try:
            llm = speculative_llm(model, drafter, num_kv_blocks=256, max_num_seqs=40, **kwargs)
            out = llm.generate(prompts, params)
        except Exception as e:  # one variant failing must not hide the others
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
            continue
        finally:
            for key, value in saved.items():
                setattr(paged_attention, key, value)
        pairs = [(c, p) for o, q in zip(out, plain, strict=True) for c, p in zip(o.outputs, q.outputs, strict=True)]
        same = sum(c.token_ids == p.token_ids for c, p in pairs)
        report(f"{name} [{same}/16 = plain]", forward_logprobs(model, truth, prompts, out), drafter)


if __name__ == "__main__":
    main()
