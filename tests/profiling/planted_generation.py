"""Synthetic GPU runs whose generation metrics come from the real engine: a tiny model decodes on the CPU under the
run's `max_num_seqs` and a KV cache sized from its `gpu_memory_utilization`, so which sequences run in each engine
step, the waits for KV blocks and the preemptions are the scheduler's own, and `rollout/*` is computed from them by
`rollout_metrics`, the function a real run uses. What is a model is the GPU's time for each step:

- a decode step is latency-bound: HOST_S of host work (more under `enforce_eager`, one launch per kernel instead
  of one graph replay) plus DEVICE_S + n * PER_SEQ_S of device time for n sequences; the device is busy only for
  the latter (`perf/gpu_util/gen`, as NVML would report it);
- the KV cache holds (gpu_memory_utilization - WEIGHTS) * BLOCKS_PER_UNIT blocks: the memory left after weights
  and activations, as the engine sizes it on a GPU.

That is the shape the doctor's advice assumes (docs/tuning-idle.md), so these runs check that each change follows
from the run's numbers and moves them the right way under it; they do not measure a GPU."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from run_helpers import one_thread  # noqa: E402
from trainer_helpers import tiny_model  # noqa: E402

from nonstop.rollout import LLM, SamplingParams  # noqa: E402
from nonstop.rollout.metrics import rollout_metrics  # noqa: E402

HOST_S, EAGER_HOST_S = 0.004, 0.012
DEVICE_S, PER_SEQ_S = 0.002, 0.00001
WEIGHTS, BLOCKS_PER_UNIT = 0.2, 1000
BLOCK_SIZE = 16
PROMPT_TOKENS = 4


def kv_blocks(gpu_memory_utilization: float) -> int:
    return int((gpu_memory_utilization - WEIGHTS) * BLOCKS_PER_UNIT)


def generation(config: dict, lengths: list[int]) -> dict[str, float]:
    """`timing_s/gen`, `perf/gpu_util/gen` and `rollout/*` of one step generating one group of `rollout.n` samples
    per entry of `lengths` (the group's response length), under `config` (dotted keys)."""
    n = config["actor_rollout_ref.rollout.n"]
    longest = PROMPT_TOKENS + max(lengths)
    llm = LLM(
        tiny_model(),
        device="cpu",
        max_model_len=longest,
        max_num_seqs=config["actor_rollout_ref.rollout.max_num_seqs"],
        num_kv_blocks=kv_blocks(config["actor_rollout_ref.rollout.gpu_memory_utilization"]),
    )
    prompts = [[8 + i % 20, 9, 10, 11] for i in range(len(lengths))]
    params = [SamplingParams(n=n, max_tokens=m, ignore_eos=True, seed=i) for i, m in enumerate(lengths)]
    with one_thread(), llm.stats_window() as window:
        llm.generate(prompts, params)
    host = EAGER_HOST_S if config.get("actor_rollout_ref.rollout.enforce_eager") else HOST_S
    steps = [replace(s, wall_s=host + DEVICE_S + s.num_seqs * PER_SEQ_S) for s in window.steps]
    wall = sum(s.wall_s for s in steps)
    busy = sum(s.wall_s - host for s in steps)
    return {
        **rollout_metrics(window.stats(), steps),
        "timing_s/gen": wall,
        "perf/gpu_util/gen": 100 * busy / wall,
    }


def step_metrics(config: dict, lengths: list[int], rest_s: float = 3.0) -> dict[str, float]:
    """A sync step: the generation above, then `rest_s` of update (the GPU busy throughout it)."""
    gen = generation(config, lengths)
    return {
        **gen,
        "timing_s/step": gen["timing_s/gen"] + rest_s,
        "timing_s/update_actor": rest_s,
        "timing_s/reward": 0.0,
        "timing_s/update_weights": 0.0,
        "perf/gpu_util/update_actor": 100.0,
    }


# -- the overlap modes and split placement: models, not runs ---------------------------------------------------------
# What the trainer would record under a change of trainer.mode or placement cannot be re-computed on a CPU: these
# give the metrics such a run would record under a simple work-conserving model of a shared GPU, so the tests check
# the doctor's accounting after the change (what it counts, where, and that the cause shrinks), not the modes.


def one_step_off(sync: dict[str, float]) -> dict[str, float]:
    """Colocated one_step_off from a sync step's metrics: the next step's decode runs beside this step's update,
    its kernels filling the update's device time and its host gaps filled by the update's kernels; the trainer
    finishes after the update plus decode's device time, then waits in `update_weights` for the block to finish."""
    gen, busy = sync["timing_s/gen"], sync["perf/gpu_util/gen"] / 100
    train = sync["timing_s/step"] - gen + gen * busy
    wait = max(0.0, gen - train)
    return {
        **sync,
        "timing_s/gen": 0.0,
        "timing_s/update_weights": wait,
        "perf/gpu_util/update_weights": 100 * busy,
        "timing_s/step": train + wait,
        "rollouter/idle_ratio": max(0.0, 1 - gen / (train + wait)),
    }


def partial_rollouts(sync: dict[str, float]) -> dict[str, float]:
    """Colocated async (partial rollouts) from a sync step's metrics: as `one_step_off`, but the tail's sequences
    continue into the next block, so a block costs the generation time less the tail's idle share, and the trainer
    waits for it in `gen`."""
    fill = sync.get("rollout/tail_batch_fill", 0.125)
    tail_idle = sync["timing_s/gen"] * sync["rollout/tail_frac"] * (1 - fill)
    overlapped = one_step_off({**sync, "timing_s/gen": sync["timing_s/gen"] - tail_idle})
    wait = overlapped.pop("timing_s/update_weights")
    return {
        **overlapped,
        "timing_s/gen": wait,
        "timing_s/update_weights": 0.0,
        "perf/gpu_util/gen": sync["perf/gpu_util/gen"],
    }


def split(gen_work: float, train_work: float, num_gpus: int, rollout_gpus: int) -> dict[str, float]:
    """Split placement: each side's GPU-seconds of work per step spread evenly over its GPUs, the two sides at once."""
    gen, train = gen_work / rollout_gpus, train_work / (num_gpus - rollout_gpus)
    step = max(gen, train)
    return {
        "timing_s/step": step,
        "timing_s/gen": step - train,
        "trainer/idle_ratio": 1 - train / step,
        "rollouter/idle_ratio": 1 - gen / step,
    }


def pipeline(gen: list[float], train: float, staleness: int, drain: bool) -> tuple[list[float], float]:
    """The trainer's wait per step and the rollouter's idle share when block j (generation time gen[j]) may start
    once version j - 1 - `staleness` is published and block j - 1 is done, each step trains `train` seconds on its
    block, and (`drain`) a publish first waits for the block in flight. Version -1 is the start."""
    done: list[float] = []
    publish: list[float] = []
    waits: list[float] = []
    idle = 0.0

    def published(version: int) -> float:
        return 0.0 if version < 0 else publish[version]

    def train_step(k: int, next_begin: float | None, next_done: float | None) -> None:
        start = max(published(k - 1), done[k])
        trained = start + train
        drained = drain and next_begin is not None and next_begin < trained
        publish.append(max(trained, next_done) if drained else trained)
        waits.append(start - published(k - 1) + publish[k] - trained)

    for j, g in enumerate(gen):
        if staleness == 0 and j > 0:  # block j waits for version j - 1: nothing is in flight at that publish
            train_step(j - 1, None, None)
        begin = max(done[j - 1] if j else 0.0, published(j - 1 - staleness))
        idle += begin - (done[j - 1] if j else 0.0)
        done.append(begin + g)
        if staleness > 0 and j > 0:
            train_step(j - 1, begin, done[j])
    train_step(len(gen) - 1, None, None)
    return waits, idle / publish[-1]
