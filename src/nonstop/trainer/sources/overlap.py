"""What the overlap modes share, on one device (overlapped.py) and on split placement's rollout ranks
(rollout_rank.py): the staleness policy of `trainer.mode`, a rollouter started on the run's data and seeds with
each finished group submitted for scoring, and a block's groups as samples."""

from __future__ import annotations

from collections.abc import Callable

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.config import NonstopConfig
from nonstop.config.async_training import STREAM_PRIORITIES
from nonstop.data import TokenizedPrompt
from nonstop.rollout import LLM
from nonstop.trainer.sampling import Sampling
from nonstop.trainer.scores import Scorer, train_prefix
from nonstop.trainer.sources.groups import Group
from nonstop.trainer.sources.rollouter import Rollouter


def overlap_policy(config: NonstopConfig) -> tuple[int, bool]:
    """(max_staleness, partial_rollout) of `trainer.mode`: `one_step_off` is verl's recipe (1, no partial rollout)
    whatever `async_training` says; `sync` driven by a rollouter (split placement) is staleness 0: a block is
    generated only once the weights that train it are in the engine."""
    mode, async_cfg = config.trainer.mode, config.async_training
    if mode == "sync":
        return 0, False
    if mode == "one_step_off":
        return 1, False
    return async_cfg.max_staleness, async_cfg.partial_rollout


def start_rollouter(
    config: NonstopConfig,
    llm: LLM,
    next_prompts: Callable[[], list[TokenizedPrompt]],
    sampling: Sampling,
    scorer: Scorer,
    batch_size: int,
    total_steps: int,
    version: int,
    loader_state: Callable[[], dict | None],
    first_index: int = 0,
) -> Rollouter:
    """A started rollouter admitting `batch_size` prompts a block from `next_prompts()` (prompt i of a block seeded
    as prompt `first_index + i` of its step: a rank's share numbers its prompts on from the ranks before it), every
    finished group submitted to `scorer` under its step's `train_prefix`, from policy version `version` on."""
    max_staleness, partial_rollout = overlap_policy(config)
    n = sampling.train.n
    tail = config.actor_rollout_ref.rollout.tail

    def submit(group: Group) -> None:
        step, index = divmod(group.index, batch_size)
        scorer.submit(train_prefix(step + 1), index * n, group_samples(group))

    rollouter = Rollouter(
        llm,
        next_prompts,
        lambda g, prompt: sampling.group_params(g, prompt, batch_size, first_index),
        batch_size=batch_size,
        total_groups=total_steps * batch_size,
        max_staleness=max_staleness,
        partial_rollout=partial_rollout,
        on_group_done=submit,
        version=version,
        loader_state=loader_state,
        stream_priority=STREAM_PRIORITIES[config.async_training.rollout_stream_priority],
        tail_frac=tail.min_running_frac if tail.enable and config.trainer.mode == "one_step_off" else None,
    )
    rollouter.start()
    return rollouter


def group_samples(group: Group) -> list[Sample]:
    row = group.prompt.row
    return [
        Sample(
            prompt_token_ids=list(group.prompt.prompt_token_ids),
            response_token_ids=list(group.token_ids[i]),
            rollout_logprobs=list(group.logprobs[i]),
            finish_reason=group.finish_reasons[i],
            uid=row.uid,
            data_source=row.data_source,
            ground_truth=row.ground_truth,
            extra_info=dict(row.extra_info),
            raw_prompt=list(row.prompt),
            token_policy_versions=list(group.versions[i]),
        )
        for i in range(len(group.token_ids))
    ]


def block_batch(groups: list[Group], max_response_length: int) -> RolloutBatch:
    return RolloutBatch([s for g in groups for s in group_samples(g)], max_response_length)


def staleness_metrics(
    batch: RolloutBatch, version: int, max_staleness: int, prefix: str = "async/staleness"
) -> dict[str, float]:
    """Per sample: `version` (the weights being trained) minus the oldest version that sampled one of its tokens;
    their mean, max and histogram (`frac_k`, k up to the bound)."""
    lags = [version - min(s.token_policy_versions, default=version) for s in batch.samples]
    metrics = {
        f"{prefix}/mean": sum(lags) / len(lags),
        f"{prefix}/max": float(max(lags)),
    }
    for k in range(max_staleness + 1):
        metrics[f"{prefix}/frac_{k}"] = sum(lag == k for lag in lags) / len(lags)
    return metrics
