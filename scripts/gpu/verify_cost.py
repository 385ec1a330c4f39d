"""What a verify launch's wall time is made of, by rows and draft length: the device time of its K rounds (CUDA events
around the launch), the host work before it (plan, enqueue) and after it (read-back, `keep_rounds`, stream
bookkeeping), against a plain decode step's period at the same rows. Chained launches hide the host's work behind the
device's: then a round's wall time comes close to its device time. Random weights in a model's shape, fixed-length
responses; every row drafts its full length every round (a stand-in drafter), so the device time is the worst case.

    python3 scripts/gpu/verify_cost.py [--shape smollm2-135m] [--rows 8,32,64] [--drafts 2,4,8] [--unchained]
        [--out cost.json]

`--unchained` also measures each case with every verify launch read before the next is planned (marked * in the
table).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from nonstop.bench.shapes import model_config, tiny_config
from nonstop.bench.trainer_step import device_sync
from nonstop.models import CausalLM
from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.scheduler import Scheduler
from nonstop.rollout.spec.launcher import VerifyLauncher
from nonstop.rollout.spec.round_plan import RoundPlanner


def full_drafter(tokens_SL, lengths_S, own_N, streams_NG, num_draft):
    """Every row drafts `num_draft` tokens (its stream's first ones): the round's most expensive case."""
    drafts_ND = tokens_SL[own_N, :num_draft].long()
    return drafts_ND, torch.full_like(own_N, num_draft)


class Timers:
    """Wraps the verify path's host steps with wall clocks, and the launch with CUDA events."""

    def __init__(self):
        self.plan, self.launch, self.read, self.keep, self.events = [], [], [], [], []

    def install(self):
        timers = self
        run, keep_rounds, plan = VerifyLauncher._run, Scheduler.keep_rounds, RoundPlanner.plan
        cuda = torch.cuda.is_available()

        def timed_plan(planner, *args):
            t0 = time.perf_counter()
            result = plan(planner, *args)
            timers.plan.append(time.perf_counter() - t0)
            return result

        def timed_run(launcher, num_rows):
            # Events on the stream: the start is reached when the launch before ends (chained) or after the upload,
            # so start to end is this launch's device time either way.
            t0 = time.perf_counter()
            if cuda:
                timers.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                timers.events[-1][0].record()
            step = run(launcher, num_rows)
            if cuda:
                timers.events[-1][1].record()
            timers.launch.append(time.perf_counter() - t0)
            read = step.read

            def timed_read():
                t1 = time.perf_counter()
                outcome = read()
                timers.read.append(time.perf_counter() - t1)
                return outcome

            step.read = timed_read
            return step

        def timed_keep(scheduler, batch, rounds):
            t0 = time.perf_counter()
            result = keep_rounds(scheduler, batch, rounds)
            timers.keep.append(time.perf_counter() - t0)
            return result

        VerifyLauncher._run, Scheduler.keep_rounds, RoundPlanner.plan = timed_run, timed_keep, timed_plan

    def clear(self):
        for name in ("plan", "launch", "read", "keep", "events"):
            getattr(self, name).clear()

    def summary(self, rounds: int) -> dict:
        device_sync()
        device = [s.elapsed_time(e) / 1e3 for s, e in self.events]
        med = lambda xs: statistics.median(xs) * 1e3 / rounds if xs else float("nan")  # noqa: E731
        return {"launches": len(device), "device_ms": med(device), "plan_ms": med(self.plan),
                "launch_ms": med(self.launch), "read_ms": med(self.read), "keep_ms": med(self.keep)}  # fmt: skip


def kernel_table(llm, prompts, params) -> list:
    """CUDA kernel time by kernel name over one more generation, in us per verify round (or decode step)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    steps = int(llm.metrics.get("rollout/spec/num_verify_steps", 0)) or params.max_tokens
    kernels = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:70]] += e.device_time_total
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:14]
    return [("TOTAL", sum(kernels.values()) / steps)] + [(k, v / steps) for k, v in top]


def measure(model, rows: int, drafts: int | None, tokens: int, K: int, timers: Timers,
            profile_kernels: bool = False, chain: bool = True) -> dict:  # fmt: skip
    prompts = [torch.randint(0, min(1000, model.config.vocab_size), (96,)).tolist() for _ in range(rows // 8)]
    params = SamplingParams(n=8, temperature=0.6, max_tokens=tokens, seed=0, ignore_eos=True)
    kwargs = {}
    if drafts is not None:
        kwargs["speculative_config"] = {"method": "suffix", "draft_rule": "always", "num_speculative_tokens": drafts,
                                        "disable_by_batch_size": rows, "verify_token_budget": 0}  # fmt: skip
    llm = LLM(model, max_num_seqs=rows, gpu_memory_utilization=0.3, num_scheduler_steps=K, **kwargs)
    if drafts is not None:
        llm.llm_engine.model_runner.verify.drafter = full_drafter
    if not chain:  # every verify launch read before the next is planned (the engine before chaining)
        llm.llm_engine._chained_verify = lambda: None
    llm.generate(prompts, params)  # warm-up: graph captures
    timers.clear()
    device_sync()
    start = time.perf_counter()
    llm.generate(prompts, params)
    device_sync()
    wall = time.perf_counter() - start
    row = {"rows": rows, "drafts": drafts, "chain": chain, "wall_s": wall}
    if drafts is None:
        row["step_ms"] = wall / tokens * 1e3
    else:
        rounds = int(llm.metrics.get("rollout/spec/num_verify_steps", 0))
        row |= timers.summary(K)  # before the profiled generation, whose launches the profiler slows
        row["round_wall_ms"] = wall / max(rounds, 1) * 1e3
        row["verify_rounds"] = rounds
        row["chained_frac"] = llm.metrics.get("rollout/spec/chained_frac", 0.0)
    if profile_kernels and torch.cuda.is_available():
        row["kernels"] = kernel_table(llm, prompts, params)
    del llm
    gc.collect()  # the engine's reference cycles hold its KV cache until collected
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--rows", default="8,32,64")
    parser.add_argument("--drafts", default="2,4,8")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--unchained", action="store_true", help="also each case with verify launches unchained")
    parser.add_argument("--profile", default="64:8", help="rows:drafts whose kernels are profiled (and plain at rows)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = tiny_config() if args.shape == "tiny" else model_config(args.shape)
    model = CausalLM(config).to(args.device, torch.bfloat16 if args.device == "cuda" else torch.float32).eval()
    timers = Timers()
    timers.install()
    K = 8
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        prof_rows, prof_drafts = (int(x) for x in args.profile.split(":"))
        plain = measure(model, rows, None, args.tokens, K, timers, rows == prof_rows)
        rows_out.append(plain)
        for drafts in [int(d) for d in args.drafts.split(",")]:
            for chain in (True, False) if args.unchained else (True,):
                profiled = chain and (rows, drafts) == (prof_rows, prof_drafts)
                row = measure(model, rows, drafts, args.tokens, K, timers, profiled, chain)
                row["round_over_step"] = row["round_wall_ms"] / plain["step_ms"]
                row["device_over_step"] = row["device_ms"] / plain["step_ms"]
                rows_out.append(row)
    for r in rows_out:
        if "kernels" in r:
            print(f"\nkernels, rows {r['rows']} drafts {r['drafts']} (us per round/step):")
            for name, us in r["kernels"]:
                print(f"  {us:8.1f}  {name}")
    print(f"\n{'rows':>5} {'D':>4} {'step/round ms':>13} {'device':>7} {'plan':>6} {'read':>6} {'keep':>6} "
          f"{'round/step':>10} {'device/step':>11} {'chained':>7}")  # fmt: skip
    for r in rows_out:
        if r["drafts"] is None:
            print(f"{r['rows']:>5} {'-':>4} {r['step_ms']:>13.3f}")
        else:
            mark = "" if r["chain"] else "*"
            print(f"{r['rows']:>5} {r['drafts']:>3}{mark:1} {r['round_wall_ms']:>13.3f} {r['device_ms']:>7.3f} "
                  f"{r['plan_ms']:>6.3f} {r['read_ms']:>6.3f} {r['keep_ms']:>6.3f} {r['round_over_step']:>10.2f} "
                  f"{r['device_over_step']:>11.2f} {r['chained_frac']:>7.2f}")  # fmt: skip
    if args.out:
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        json.dump({"gpu": gpu, "torch": torch.__version__, "args": vars(args),
                   "rows": rows_out}, open(args.out, "w"), indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
