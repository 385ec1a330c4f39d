"""`nonstop bench spec`: generation with and without speculative decoding, in the same run, on a real model and real
prompts (GSM8K training prompts through the data loading and the chat template, n samples each).

Online (the default; a GPU): per temperature and number of prompts, one engine generates the same prompts with the
same seeds `--repeats` times on each side, interleaved (plain and spec taking turns to go first) after a warm-up of
each: plain (speculation off), spec (the
configured rule, the history of earlier responses cleared before each run: a prompt seen for the first time) and
spec+history (the previous repeat's responses kept, as when a prompt returns in a later epoch). Reported: median
generation wall time per side, the speed-up, acceptance rate, tokens per sequence per verify round, verify rounds as
a share of the drafting range's decode steps, what the draft rule learnt, the seconds CUDA-graph captures took
inside the timed runs (plain / spec / spec+history: a new launch shape's one-off cost), and how many samples equal
plain's (all, where verify and decode compute bit-identical logits; bf16 kernels may differ in the last bit, and a
sample that draws another token there continues differently, as exactly distributed).

`--offline` (any device, CPU included): plain generations only, then the device drafter replayed over them
(rollout/spec/replay.py; exact, since the tokens a verify round keeps are the plain tokens): acceptance, tokens per
verify round and the decode-step speed-up at assumed round costs (its ceiling where a round costs a plain step, and
the most a round may cost for TARGET_SPEEDUP), for the configured drafter and for the issue's
calibration drafter (suffix matches of up to 6 tokens, 4 draft tokens, drafting every step), and a second epoch of
the same prompts drafted from the first's responses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from nonstop.bench.env import default_result_path, environment, write_result
from nonstop.config.assign import parse_key_values
from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.spec.replay import replay

DEFAULT_DATA = "/work/shared/data/gsm8k/train.jsonl"
COST_RATIOS = (1.0, 1.3, 1.6)  # verify round / plain decode step, for the offline speed-up estimates
# A token's cost in decode-step floors, for the offline estimates priced by tokens (`ReplayStats.token_speedup`): a
# plain step's time grows by about this much per row: 0.0016 fits SmolLM2-135M on an H100
# (bench/results/2026-12-07-cpu-spec-offline-budget-10ebb0d/; docs/engine.md: how to measure it for another).
TOKEN_COSTS = (0.0016, 0.004)
# The speed-up the offline table prices a round for (`ReplayStats.break_even_round`, at TOKEN_COSTS[0]).
TARGET_SPEEDUP = 1.5
# The calibration drafter: longest suffix match of up to 6 tokens over the sequence, its siblings and the
# prompt, 4 draft tokens, every step drafting.
CALIBRATION = dict(
    prompt_lookup_max=6, num_speculative_tokens=4, disable_by_batch_size=1 << 30, draft_from_other_groups=False
)


# examples/gsm8k_smollm2.yaml's data.max_prompt_length: the trainer sizes its engine to that plus the responses.
GSM8K_PROMPT_CAP = 320


def engine_len(max_model_len: int | None, max_tokens: int) -> int:
    return max_model_len or GSM8K_PROMPT_CAP + max_tokens


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nonstop bench spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint: HF directory (a trained actor) or .gguf; default: "
                        "the embedded SmolLM2-135M-Instruct")  # fmt: skip
    parser.add_argument("--data", default=DEFAULT_DATA, help="GSM8K training file (JSONL or parquet)")
    parser.add_argument("--temperatures", type=_floats, default=[0.6, 1.0])
    parser.add_argument("--prompts", type=_ints, default=[1, 8, 32], help="prompts per run (x n sequences)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help=f"the engine's context length (default: {GSM8K_PROMPT_CAP} + --max-tokens, as the GRPO "
                        "example's engine; kernel launches read it)")  # fmt: skip
    parser.add_argument("--spec", nargs="*", default=[], help="speculative config keys, key=value (YAML values)")
    parser.add_argument("--offline", action="store_true", help="replay the drafter over plain generations instead")
    parser.add_argument("--samples", default=None, help="also write each case's plain samples here (two generations "
                        "of the prompts: online the first two timed repeats, offline the two epochs; JSON), to replay "
                        "drafters over later with --from-samples")  # fmt: skip
    parser.add_argument("--from-samples", default=None, help="with --offline: replay over the samples a --samples run "
                        "wrote (its cases, no model run) instead of generating")  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/spec-<time>.json)")
    return parser.parse_args(argv)


def gsm8k_prompts(tokenizer, path: str, num: int, offset: int = 0) -> list[list[int]]:
    """The first `num` training prompts from `offset` on, as the trainer builds them (chat template, ready for the
    assistant's turn)."""
    from nonstop.data.dataset import PromptDataset
    from nonstop.data.readers import read_rows

    rows = read_rows(path)[offset : offset + num]
    return [item.prompt_token_ids for item in PromptDataset(rows, tokenizer, max_prompt_length=1 << 16).items]


def sampling(args, temperature: float, num_prompts: int, seed: int) -> list[SamplingParams]:
    return [SamplingParams(n=args.n, temperature=temperature, max_tokens=args.max_tokens, seed=seed * 100_003 + i,
                           detokenize=False) for i in range(num_prompts)]  # fmt: skip


def timed_generate(llm: LLM, prompts, params) -> tuple[list[list[int]], float, dict]:
    """The samples' token ids, the wall time, and the call's metrics with `steps`: where the time went. Every call
    prefills its prompts afresh, as a GRPO step after a weight update does (cached prompt KV from an earlier call
    would make one side's prefill nearly free and the other's not)."""
    llm.reset_prefix_cache()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with llm.llm_engine.stats_window() as window:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        sync()
        wall = time.perf_counter() - start
    samples = [c.token_ids for o in outputs for c in o.outputs]
    return samples, wall, {**llm.metrics, "steps": step_breakdown(window.steps, wall, samples)}


def step_breakdown(steps, wall_s: float, samples: list[list[int]]) -> dict:
    """Engine steps and their seconds by what each launched (prefill, decode, a verify launch planned afresh, one
    chained behind the launch in flight, nothing), the seconds outside any step, and the longest sample's length (a
    generation lasts as long as its longest sample: the sides' own samples differ)."""
    kinds = {}
    for step in steps:
        kind = kinds.setdefault(step.launch or "read", {"steps": 0, "s": 0.0})
        kind["steps"] += 1
        kind["s"] += step.wall_s
    outside = wall_s - sum(step.wall_s for step in steps)
    return {"kinds": kinds, "outside_s": outside, "longest": max(map(len, samples), default=0)}


def replay_plain(llm: LLM, prompts, samples: list[list[int]], n: int, config: SpeculativeConfig) -> dict:
    """The drafter replayed over one plain generation's samples (rollout/spec/replay.py, on the engine's device): the
    rounds it would take, the speed-up priced by tokens at TOKEN_COSTS[0], its ceiling, and the most the rounds may
    cost, in plain steps of their rows, for TARGET_SPEEDUP; decode steps only."""
    groups = [(prompt, samples[i * n : (i + 1) * n]) for i, prompt in enumerate(prompts)]
    with torch.inference_mode():
        stats = replay(groups, config, device=llm.llm_engine.model_runner.device)
    cost = TOKEN_COSTS[0]
    return {"verify_steps": stats.verify_steps, "plain_steps": stats.plain_steps,
            "tokens_per_verify": stats.tokens_per_verify, "token_speedup": stats.token_speedup(cost),
            "free_speedup": stats.free_speedup(cost),
            "break_even_round": stats.break_even_round(TARGET_SPEEDUP, cost)}  # fmt: skip


def round_over_plain(spec_steps: dict, spec_metrics: dict, plain_steps: dict) -> float | None:
    """A verify round's wall time against a plain step's, from one repeat's two sides: the spec side's verify
    launches' seconds (fresh and chained, and the read that ends a chain) over its rounds, against the plain side's
    decode seconds over its decode steps (its longest sample's tokens after the prefill's). The plain steps run at
    every row count the generation passes through, the rounds at those of the drafting range, so this compares with
    `break_even_round` only roughly. None where nothing verified."""
    rounds = spec_metrics.get("rollout/spec/num_verify_steps", 0)
    steps = plain_steps["longest"] - 1
    if not rounds or steps < 1:
        return None
    # The spec side's read steps: the read of a chain's last launch, which waits for its rounds.
    round_s = sum(spec_steps["kinds"].get(k, {}).get("s", 0.0) for k in ("verify", "chained", "read")) / rounds
    plain_s = sum(plain_steps["kinds"].get(k, {}).get("s", 0.0) for k in ("decode", "read")) / steps
    return round_s / plain_s if plain_s else None


def run_online(llm: LLM, prompts, args, temperature: float, config: SpeculativeConfig) -> dict:
    """One (temperature, prompts) case: plain, spec and spec+history, `--repeats` times each, interleaved; and the
    drafter replayed over each repeat's plain samples (`replay_plain`)."""
    engine = llm.llm_engine
    speculator = engine.speculator
    history = engine.model_runner.verify.history
    sides = {"plain": [], "spec": [], "spec_history": []}
    spec_metrics, history_metrics, identical, replays, round_costs, kept = [], [], [], [], [], []
    captures = {side: [] for side in sides}  # seconds of CUDA-graph captures inside each timed run
    breakdown = {side: [] for side in sides}  # per repeat: `step_breakdown`
    for repeat in range(args.repeats + 1):  # the first round warms up (graph captures, autotuning)
        params = sampling(args, temperature, len(prompts), seed=repeat)
        # Plain first in even repeats, spec first in odd ones: what runs second should not be the same side each time.
        runs = {}
        for side in ("plain", "spec") if repeat % 2 == 0 else ("spec", "plain"):
            engine.speculator = speculator if side == "spec" else None
            if side == "spec":
                history.responses.clear()
            runs[side] = timed_generate(llm, prompts, params)
        (plain, plain_s, p_metrics), (spec, spec_s, metrics) = runs["plain"], runs["spec"]
        engine.speculator = speculator
        # The responses of this run stay as the history a later epoch of these prompts would draft from.
        history_params = sampling(args, temperature, len(prompts), seed=repeat + 1000)
        _, history_s, h_metrics = timed_generate(llm, prompts, history_params)
        if repeat == 0:
            continue
        if len(kept) < 2:  # for --samples
            kept.append([plain[i * args.n : (i + 1) * args.n] for i in range(len(prompts))])
        sides["plain"].append(plain_s)
        sides["spec"].append(spec_s)
        sides["spec_history"].append(history_s)
        spec_metrics.append(metrics)
        history_metrics.append(h_metrics)
        for side, m in (("plain", p_metrics), ("spec", metrics), ("spec_history", h_metrics)):
            captures[side].append(m.get("rollout/graph_capture_s", 0.0))
            breakdown[side].append(m["steps"])
        identical.append(sum(a == b for a, b in zip(plain, spec, strict=True)) / len(plain))
        replays.append(replay_plain(llm, prompts, plain, args.n, config))
        cost = round_over_plain(metrics["steps"], metrics, p_metrics["steps"])
        round_costs += [cost] if cost is not None else []
    wall = {side: statistics.median(times) for side, times in sides.items()}
    # Paired per repeat: a repeat's seed sets its response lengths, and a round lasts as long as its longest response.
    paired = {side: statistics.median(p / s for p, s in zip(sides["plain"], sides[side], strict=True))
              for side in ("spec", "spec_history")}  # fmt: skip
    # The same per token of each side's longest sample: the sides' samples differ (bf16 verify and decode round apart),
    # and a generation lasts as long as its longest one; this takes that draw out of the ratio.
    per_longest = statistics.median(
        (p / bp["longest"]) / (s / bs["longest"])
        for p, s, bp, bs in zip(sides["plain"], sides["spec"], breakdown["plain"], breakdown["spec"], strict=True)
    )
    return {
        "wall_s": wall,
        "wall_s_all": sides,
        "speedup": paired["spec"],
        "speedup_history": paired["spec_history"],
        "speedup_per_longest": per_longest,
        "steps": breakdown,
        "spec": _mean_metrics(spec_metrics),
        "spec_history": _mean_metrics(history_metrics),
        "identical_to_plain": statistics.mean(identical),
        "graph_capture_s": {side: statistics.mean(times) for side, times in captures.items()},
        "generated_tokens": statistics.mean(m["rollout/generated_tokens"] for m in spec_metrics),
        "rule": rule_state(speculator.policy),
        # Medians over the repeats: what the drafts allow (replayed over the plain side) against what the rounds cost.
        "replay": {key: statistics.median(r[key] for r in replays) for key in replays[0]},
        "round_over_plain": statistics.median(round_costs) if round_costs else None,
        "_samples": {"prompts": [list(p) for p in prompts], "epochs": kept},  # for --samples; not in the result
    }


def rule_state(policy) -> dict:
    """What the draft rule has learnt by the end of a case: kept tokens per round, the recent round and plain-step
    times (ms) and their ratio."""
    ratio = policy.cost_ratio()
    return {"gain": policy.gain, "cost_ratio": ratio, "round_ms": [t * 1e3 for t in policy.round_times],
            "plain_ms": [t * 1e3 for t in policy.plain_times]}  # fmt: skip


def _mean_metrics(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if k.startswith("rollout/spec/") or k == "rollout/small_batch_frac"]
    return {k.removeprefix("rollout/"): statistics.mean(r.get(k, 0.0) for r in runs) for k in keys}


def generate_epochs(llm: LLM, prompts, args, temperature: float) -> dict:
    """Two plain generations of the prompts (other seeds), as `--samples` writes them, and their wall times."""
    llm.llm_engine.speculator = None
    epochs, walls = [], []
    for epoch in range(2):
        outputs, wall, _ = timed_generate(llm, prompts, sampling(args, temperature, len(prompts), seed=epoch))
        epochs.append([outputs[i * args.n : (i + 1) * args.n] for i in range(len(prompts))])
        walls.append(wall)
    return {"prompts": [list(p) for p in prompts], "epochs": epochs, "wall_s": walls}


def run_offline(samples: dict, config: SpeculativeConfig) -> dict:
    """The drafter replayed over two plain generations of the same prompts (`generate_epochs`' dict; the second
    drafting from the first's responses too, as a later epoch)."""
    epochs = [list(zip(samples["prompts"], outputs, strict=True)) for outputs in samples["epochs"]]
    walls = samples.get("wall_s")
    calibration = dataclasses.replace(config, **CALIBRATION)
    result = {"plain_wall_s": walls, "calibration": replay(epochs[0], calibration).to_json()}
    history, target = [outputs for _, outputs in epochs[0]], TARGET_SPEEDUP
    for name, groups, past in (("epoch1", epochs[0], None), ("epoch2_history", epochs[1], history)):
        stats = replay(groups, config, past)
        result[name] = {**stats.to_json(), "speedup": {str(r): stats.speedup(r) for r in COST_RATIOS},
                        "token_speedup": {str(c): stats.token_speedup(c) for c in TOKEN_COSTS},
                        "free_speedup": {str(c): stats.free_speedup(c) for c in TOKEN_COSTS},
                        "break_even_round": {str(target): stats.break_even_round(target, TOKEN_COSTS[0])}}  # fmt: skip
    every_step = dataclasses.replace(config, disable_by_batch_size=1 << 30)
    result["every_step"] = replay(epochs[0], every_step).to_json()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = {"method": "suffix", **parse_key_values(args.spec)}
    config = SpeculativeConfig(**spec)
    if args.from_samples:
        return replay_samples(args, config, argv)
    from nonstop.models.loading import default_model_path

    model = args.model or str(default_model_path())
    max_num_seqs = max(args.prompts) * args.n
    llm = LLM(model, device=args.device, max_num_seqs=max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=engine_len(args.max_model_len, args.max_tokens),
              speculative_config=dataclasses.asdict(config))  # fmt: skip
    if not args.offline and llm.llm_engine.model_runner.device.type != "cuda":
        raise SystemExit("nonstop bench spec needs a CUDA GPU (or --offline)")
    out = args.out or default_result_path("spec")
    payload = {
        "environment": environment(),
        "command": "nonstop bench spec " + " ".join(argv or []),
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "model": model},
        "speculative_config": dataclasses.asdict(config),
        "rows": [],
    }
    samples = {}
    for temperature in args.temperatures:
        for num_prompts in args.prompts:
            prompts = gsm8k_prompts(llm.tokenizer, args.data, num_prompts)
            row = {"temperature": temperature, "prompts": num_prompts, "sequences": num_prompts * args.n}
            key = f"T{temperature}_P{num_prompts}"
            if args.offline:
                samples[key] = generate_epochs(llm, prompts, args, temperature)
                row.update(run_offline(samples[key], config))
            else:
                row.update(run_online(llm, prompts, args, temperature, config))
                samples[key] = row.pop("_samples")
            if args.samples:
                with open(args.samples, "w") as f:
                    json.dump(samples, f)
            payload["rows"].append(row)
            write_result(out, payload)  # after every case: a time limit keeps the rest
            print(json.dumps(row), flush=True)
    print_table(payload["rows"], args.offline)
    return 0


def replay_samples(args, config: SpeculativeConfig, argv: list[str] | None) -> int:
    """`--offline --from-samples`: `run_offline` over every case of a `--samples` file."""
    if not args.offline:
        raise SystemExit("--from-samples replays offline: add --offline")
    with open(args.from_samples) as f:
        cases = json.load(f)
    out = args.out or default_result_path("spec")
    payload = {"environment": environment(), "command": "nonstop bench spec " + " ".join(argv or []),
               "settings": {k: v for k, v in vars(args).items() if k != "out"},
               "speculative_config": dataclasses.asdict(config), "rows": []}  # fmt: skip
    for key, samples in cases.items():
        if len(samples["epochs"]) < 2:
            raise SystemExit(
                f"{args.from_samples}: case {key} holds {len(samples['epochs'])} generation(s), the "
                "replay needs two (an online --samples run keeps its first two timed repeats)"
            )
        temperature, num_prompts = key.removeprefix("T").split("_P")
        row = {"temperature": float(temperature), "prompts": int(num_prompts),
               "sequences": sum(map(len, samples["epochs"][0])), **run_offline(samples, config)}  # fmt: skip
        payload["rows"].append(row)
    write_result(out, payload)
    print_table(payload["rows"], True)
    return 0


def print_table(rows: list[dict], offline: bool) -> None:
    if offline:
        print(f"\n{'T':>4} {'seqs':>5} {'':14} {'accept':>7} {'tok/verify':>10} {'verify':>7} " +
              " ".join(f"{'x@' + str(r):>6}" for r in COST_RATIOS) + " " +
              " ".join(f"{'x@tok' + str(c):>10}" for c in TOKEN_COSTS) + f" {'ceiling':>7} {'round<=':>7}")  # fmt: skip
        for r in rows:
            for name in ("calibration", "every_step", "epoch1", "epoch2_history"):
                s = r[name]
                speedups = " ".join(f"{s['speedup'][str(c)]:>6.2f}" for c in COST_RATIOS) if "speedup" in s else ""
                if "token_speedup" in s:
                    speedups += " " + " ".join(f"{s['token_speedup'][str(c)]:>10.2f}" for c in TOKEN_COSTS)
                    speedups += (f" {s['free_speedup'][str(TOKEN_COSTS[0])]:>7.2f}"
                                 f" {s['break_even_round'][str(TARGET_SPEEDUP)]:>7.2f}")  # fmt: skip
                print(f"{r['temperature']:>4} {r['sequences']:>5} {name:14} {s['acceptance_rate']:>7.2f} "
                      f"{s['tokens_per_verify']:>10.2f} {s['verify_steps']:>7} {speedups}")  # fmt: skip
        return
    print(f"\n{'T':>4} {'seqs':>5} {'plain s':>8} {'spec s':>7} {'x':>5} {'x/len':>5} {'+hist s':>8} {'x':>5} "
          f"{'accept':>7} {'tok/verify':>10} {'verify':>7} {'same':>5} {'capture s':>9}")  # fmt: skip
    for r in rows:
        w, s = r["wall_s"], r["spec"]
        capture = "/".join(f"{c:.2f}" for c in r.get("graph_capture_s", {}).values())
        print(f"{r['temperature']:>4} {r['sequences']:>5} {w['plain']:>8.3f} {w['spec']:>7.3f} {r['speedup']:>5.2f} "
              f"{r['speedup_per_longest']:>5.2f} {w['spec_history']:>8.3f} {r['speedup_history']:>5.2f} "
              f"{s.get('spec/acceptance_rate', 0):>7.2f} {s.get('spec/tokens_per_verify', 0):>10.2f} "
              f"{s.get('spec/verify_step_frac', 0):>7.2f} {r['identical_to_plain']:>5.2f} {capture:>9}")  # fmt: skip
    print(
        f"\nwhat the drafts allow, replayed over the plain side's samples (x@tok{TOKEN_COSTS[0]}; decode steps only), "
        f"against what the rounds cost (wall, per plain step)"
    )
    print(f"{'T':>4} {'seqs':>5} {'rounds':>7} {'plain':>6} {'tok/round':>9} {'priced':>7} {'ceiling':>7} "
          f"{'round<=' + str(TARGET_SPEEDUP):>10} {'round/plain':>11}")  # fmt: skip
    for r in rows:
        if "replay" not in r:
            continue
        x, cost = r["replay"], r.get("round_over_plain")
        print(f"{r['temperature']:>4} {r['sequences']:>5} {x['verify_steps']:>7.0f} {x['plain_steps']:>6.0f} "
              f"{x['tokens_per_verify']:>9.2f} {x['token_speedup']:>7.2f} {x['free_speedup']:>7.2f} "
              f"{x['break_even_round']:>10.3f} {'-' if cost is None else f'{cost:.3f}':>11}")  # fmt: skip
    print("\nwhere the time went (last repeat; steps / seconds by what each step launched; outside: not in a step)")
    for r in rows:
        for side in ("plain", "spec"):
            b = r["steps"][side][-1]
            kinds = " ".join(f"{k} {v['steps']}/{v['s']:.3f}" for k, v in sorted(b["kinds"].items()))
            print(f"{r['temperature']:>4} {r['sequences']:>5} {side:>6} longest {b['longest']:>4} {kinds} "
                  f"outside {b['outside_s']:.3f}")  # fmt: skip
