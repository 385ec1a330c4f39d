"""`nonstop bench engine-host`: the rollout engine's host time per decode step, on CPU, with a tiny model.

On a GPU the engine's host work (scheduling, building the step's inputs, reading and processing the sampled tokens)
runs while the device computes; once it takes longer than a device step the GPU waits (the "host gap"). This
measures that host work where nothing hides it: a tiny random model on CPU, decode steps at a given number of
running sequences, and the time `LLMEngine.step` spends outside the model forward, the logits and the sampler
(timed by wrapping them) divided by the decode steps it advanced — with multi-step decode (`num_scheduler_steps`
k > 1) one `step` call advances every sequence k tokens. Times are the CPU time of the engine's thread (torch runs
on one thread here), so other load on a shared machine does not inflate them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nonstop.bench.shapes import tiny_config
from nonstop.models import CausalLM

TINY = tiny_config(vocab_size=512)


class DeviceTimer:
    """Wraps the engine's device work (model forward, logits, sampling) and sums its wall time."""

    def __init__(self, runner):
        import nonstop.rollout.model_runner as model_runner

        self.seconds = 0.0
        model = runner.model
        model.register_forward_pre_hook(lambda *_: self._start())
        model.register_forward_hook(lambda *_: self._stop())
        model.compute_logits = self._timed(model.compute_logits)
        model_runner.sample = self._timed(model_runner.sample)
        self._t0 = 0.0

    def _start(self):
        self._t0 = time.thread_time()

    def _stop(self):
        self.seconds += time.thread_time() - self._t0

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        return timed


def host_time_per_step(num_seqs: int, num_scheduler_steps: int, steps: int = 32, repeats: int = 3) -> dict:
    """Host ms per decode step (per token of every running sequence) at `num_seqs` running sequences."""
    import nonstop.rollout.model_runner as model_runner
    import nonstop.rollout.paged_attention as paged_attention
    from nonstop.rollout import LLMEngine, SamplingParams
    from nonstop.rollout.engine_args import EngineArgs

    original_sample, original_attention = model_runner.sample, paged_attention.paged_decode_attention
    # The CPU reference attention loops over sequences in Python: device work that would swamp the host's. Its
    # output does not matter for the host's work, so the query stands in for it.
    paged_attention.paged_decode_attention = lambda q_NHE, *args: q_NHE
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = CausalLM(TINY).init_weights().eval()
    max_tokens = 4 + (repeats + 1) * steps + num_scheduler_steps * 4
    args = EngineArgs(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(8192, num_seqs * 16),
        num_kv_blocks=num_seqs * (-(-(16 + max_tokens) // 16) + 1),
        num_scheduler_steps=num_scheduler_steps,
    )
    engine = LLMEngine(model, args)
    timer = DeviceTimer(engine.model_runner)
    try:
        g = torch.Generator().manual_seed(0)
        for i in range(num_seqs):
            prompt = torch.randint(0, TINY.vocab_size, (16,), generator=g).tolist()
            engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
        while engine.scheduler.waiting or any(
            s.num_cached_tokens < s.num_prompt_tokens for s in engine.scheduler.running
        ):
            engine.step()
        for _ in range(2):
            engine.step()
        host_ms, total_ms = [], []
        for _ in range(repeats):
            seq = engine.scheduler.running[0]
            tokens_before, device_before = seq.num_tokens, timer.seconds
            start = time.thread_time()
            for _ in range(max(1, steps // num_scheduler_steps)):
                engine.step()
            wall = time.thread_time() - start
            advanced = seq.num_tokens - tokens_before
            host_ms.append((wall - (timer.seconds - device_before)) / advanced * 1e3)
            total_ms.append(wall / advanced * 1e3)
        assert len(engine.scheduler.running) == num_seqs
    finally:
        model_runner.sample, paged_attention.paged_decode_attention = original_sample, original_attention
    return {
        "num_seqs": num_seqs,
        "num_scheduler_steps": num_scheduler_steps,
        "host_ms_per_step": statistics.median(host_ms),
        "total_ms_per_step": statistics.median(total_ms),
    }


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nonstop bench engine-host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=_ints, default=[256, 512], help="running sequences (comma list)")
    parser.add_argument("--num-scheduler-steps", type=_ints, default=[1, 8], help="k values (comma list)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{'seqs':>5} {'k':>3} {'host ms/step':>12} {'total ms/step':>13}")
    for n in args.num_seqs:
        for k in args.num_scheduler_steps:
            r = host_time_per_step(n, k, args.steps, args.repeats)
            print(f"{n:5d} {k:3d} {r['host_ms_per_step']:12.3f} {r['total_ms_per_step']:13.3f}", flush=True)
    return 0
