"""`nonstop bench launch-ops`: torch ops the host dispatches per decode step outside CUDA-graph replays, on CPU.

The host cost of a decode step at small batch is its eager ops (each pays Python, dispatch and
launch). This counts them with a `TorchDispatchMode` around `ModelRunner.launch` for decode launches of a tiny model,
with the graph path simulated: `DecodeGraphs` records nothing and a replay runs `decode_launch` uncounted, so what is
counted is what a CUDA launch dispatches besides its one replay (captures are not counted either). `--eager` counts
the eager path instead (the model forward excluded). Views (slice, view) are counted too: they cost host time.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nonstop.bench.shapes import tiny_config
from nonstop.models import CausalLM
from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.cuda_graphs import DecodeGraphs

WORKLOADS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
    "sampled": SamplingParams(temperature=1.0, max_tokens=33, seed=1, ignore_eos=True),
    "top-k/top-p+min_tokens": SamplingParams(
        temperature=1.0, top_k=20, top_p=0.9, max_tokens=33, min_tokens=10, stop_token_ids=[3], seed=1
    ),
}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.on, self.ops = False, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def paused(self, fn):
        def uncounted(*args, **kwargs):
            on, self.on = self.on, False
            try:
                return fn(*args, **kwargs)
            finally:
                self.on = on

        return uncounted


def ops_per_step(params: SamplingParams, k: int, graphs: bool, num_seqs: int = 8) -> tuple[float, dict]:
    torch.manual_seed(0)
    llm = LLM(CausalLM(tiny_config(vocab_size=512)).init_weights(), num_scheduler_steps=k, max_num_seqs=num_seqs)
    runner, counter, totals = llm.llm_engine.model_runner, OpCounter(), collections.Counter()
    runner.model.forward = counter.paused(runner.model.forward)
    if graphs:
        runner.graphs = DecodeGraphs(runner, num_seqs)
        capture = runner.graphs.capture

        def capture_on_cpu(shape):
            capture(shape)
            runner.planner.staged_constants = [None, None]  # on CPU the capture's padding overwrote a staging buffer

        runner.graphs._record = lambda shape: None
        runner.graphs.capture = counter.paused(capture_on_cpu)
        runner.graphs.replay = counter.paused(runner.decode_launch)
    launch = runner.launch

    def counted_launch(batch):
        if max(batch.num_new_tokens) > 1:
            return launch(batch)
        before = counter.ops.total()
        counter.on = True
        try:
            return launch(batch)
        finally:
            counter.on = False
            totals["ops"] += counter.ops.total() - before
            totals["steps"] += batch.num_scheduler_steps

    runner.launch = counted_launch
    with counter:
        llm.generate([[1, 2, 3, 4]] * num_seqs, params)
    return totals["ops"] / totals["steps"], dict(counter.ops.most_common())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nonstop bench launch-ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--eager", action="store_true", help="count the eager path (no graphs), forward excluded")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each op's count")
    args = parser.parse_args(argv)
    for name, params in WORKLOADS.items():
        for k in (1, 8):
            per_step, ops = ops_per_step(params, k, graphs=not args.eager)
            print(f"{name:24s} k={k}: {per_step:6.1f} ops per decode step")
            if args.verbose:
                print("   ", ops)
    return 0
