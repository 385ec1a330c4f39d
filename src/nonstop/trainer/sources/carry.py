"""`trainer.mode=sync` with `actor_rollout_ref.rollout.tail.enable`: a step's generation never waits for its long
tail. Each step admits its prompts as GRPO groups beside the sequences the previous step left unfinished (continued
first, on the new weights), and stops generating as soon as as many groups as it drew prompts are done, or fewer than
`tail.min_running_frac` of the phase's peak decode batch still runs, whichever comes first; what is still generating
is paused (aborted: KV released, tokens, log-probs and policy versions kept, groups.py) and carried into the next
step. The step trains every group whose n samples have all finished, in admission order (never shortest first).

Never drop, never bias: a group admitted `tail.max_staleness` versions ago is finished before the step may stop, so
no trained sample is older than the bound; the last step finishes everything, so every started sample is trained
exactly once. Tokens of older versions are corrected against their recorded log-probs by the update's token-level
importance sampling (`algorithm.rollout_correction`). The paused groups are part of the checkpoint. APRIL (slime)
and verl's partial rollouts are the published forms; docs/modes.md says when it pays.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from typing import Any

import torch

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.config import NonstopConfig
from nonstop.profiling import PhaseRecorder
from nonstop.trainer.scores import group_prefix
from nonstop.trainer.sources.base import SourceBase, StepSamples, loader_state
from nonstop.trainer.sources.batch_fill import BatchFill
from nonstop.trainer.sources.generation import EngineGeneration, copy_to_engine
from nonstop.trainer.sources.groups import Group, GroupRequests
from nonstop.trainer.sources.overlap import group_samples, staleness_metrics

# Engine steps before a stop whose mean wall time prices the tail the stop skipped (`tail/gen_time_saved_s`).
TAIL_STEPS_TIMED = 8


class CarrySource(SourceBase):
    publishes_every_step = False
    old_log_prob_from_rollout = False

    def __init__(self, config: NonstopConfig, generation: EngineGeneration, train_loader: Any, total_steps: int):
        self.config, self.generation, self.train_loader = config, generation, train_loader
        self.total_steps = total_steps
        self.tail = config.actor_rollout_ref.rollout.tail
        self.scorer = generation.scorer
        self.pool = GroupRequests(generation.llm, self._score)
        self.next_group = 0  # admission counter over the run
        # The last stop's price of a skipped tail step, and the carried sequences whose finishing steps it prices.
        self.tail_step_s = 0.0
        self.carried: set[tuple[int, int]] = set()

    def _score(self, group: Group) -> None:
        self.scorer.submit(group_prefix(group.index), 0, group_samples(group))

    def next_batch(self, step: int, rec: PhaseRecorder) -> StepSamples:
        generation, version = self.generation, step - 1
        with rec("data"):
            prompts = self.train_loader.next_batch()
        self.remember_probe([p.prompt_token_ids for p in prompts])
        metrics: dict[str, float] = {}
        with rec("gen") as span:
            with generation.engine_turn():
                if self.probe_prompts and not generation.shares_weights:
                    metrics["actor/sync_logprob_diff"] = generation.probe(self.probe_prompts, step)
                self.pool.version = version
                metrics.update(self._generate(step, prompts))
            groups = [self.pool.groups.pop(g) for g in sorted(self.pool.groups) if self.pool.groups[g].done]
            batch = carried_batch(groups, generation.sampling.train.max_tokens)
            span.tokens = sum(batch.total_lengths)
        metrics.update(staleness_metrics(batch, version, self.tail.max_staleness, prefix="tail/staleness"))
        metrics["tail/num_groups"] = float(len(groups))
        with rec("reward"):
            scores_B = torch.cat([self.scorer.collect(group_batch(g), group_prefix(g.index))[0] for g in groups])
            rewards_B = scores_B + self.scorer.shaping(batch)
        return StepSamples(batch, rewards_B, {**metrics, **self.scorer.shaping_metrics(batch)})

    def _generate(self, step: int, prompts: list) -> dict[str, float]:
        """Continue the carried sequences, admit `prompts`, step the engine until the stop rule holds, pause the
        rest; the phase's `rollout/*` and `tail/*` metrics."""
        pool, llm, version = self.pool, self.generation.llm, step - 1
        continued = len(pool.to_continue)
        pool.continue_all()  # first: the engine queues in arrival order, oldest group first
        seeded = self.generation.sampling.seeded(list(prompts), self.generation.sampling.train, step)
        for prompt, params in zip(prompts, seeded, strict=True):
            pool.admit(Group.new(self.next_group, prompt, params, version))
            self.next_group += 1
        # Groups at the staleness bound must finish now; the last step finishes everything.
        last = step == self.total_steps
        due = [g for g in pool.groups.values() if last or version - g.admitted_version >= self.tail.max_staleness]
        fill = BatchFill(llm.max_num_seqs, self.tail.min_running_frac)
        fill.observe(pool.num_in_engine())
        window = llm.stats_window()
        step_times: list[float] = []
        carried_steps = 0  # engine steps until the sequences the last stop carried had all finished
        try:
            while llm.has_unfinished_requests() and not self._may_stop(due, fill, len(prompts)):
                start = time.perf_counter()
                for output in llm.step():
                    pool.record(output)
                step_times.append(time.perf_counter() - start)
                fill.observe(pool.num_in_engine())
                if self.carried:
                    carried_steps += 1
                    self.carried = {(g, i) for g, i in self.carried if pool.groups[g].finish_reasons[i] is None}
            metrics = window.pop()
        except BaseException:
            llm.abort(list(pool.requests))  # the engine left empty for the KV release; the run fails with this error
            raise
        finally:
            window.close()
        metrics["tail/gen_time_saved_s"] = carried_steps * self.tail_step_s
        pool.abort_all()  # what runs on is carried: its KV released, its tokens kept
        paused = pool.to_continue
        self.carried = set(paused)
        recent = step_times[-TAIL_STEPS_TIMED:]
        self.tail_step_s = sum(recent) / len(recent) if recent else 0.0
        metrics.update(
            {
                "tail/num_continued": float(continued),
                "tail/num_carried": float(len(paused)),
                "tail/carried_tokens": float(sum(len(pool.groups[g].token_ids[i]) for g, i in paused)),
                "tail/batch_fill/mean": fill.mean,
                "tail/stopped_early": float(bool(paused)),
            }
        )
        return metrics

    def _may_stop(self, due: list[Group], fill: BatchFill, batch_size: int) -> bool:
        """Every due group is done, and either `batch_size` groups are (the batch's) or the decode batch is in its
        tail with at least one group to train."""
        if not all(g.done for g in due):
            return False
        done = sum(g.done for g in self.pool.groups.values())
        return done >= batch_size or (fill.in_tail and done > 0)

    def publish_weights(self, version: int) -> None:
        copy_to_engine(self.generation.model, self.generation.llm)

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return self.generation.kv.step_metrics(metrics)

    def paused(self) -> nullcontext:
        return nullcontext()  # the engine only runs inside `next_batch`; carried groups wait outside it

    def loader_state(self, step: int) -> dict[str, Any] | None:
        return loader_state(self.train_loader)

    def state_dict(self) -> dict[str, Any]:
        """The paused groups (every admitted group not yet trained) and where admission and the time estimate are."""
        return {
            **super().state_dict(),
            "groups": [g.state_dict() for g in self.pool.groups.values()],
            "to_continue": self.pool.to_continue,
            "next_group": self.next_group,
            "tail_step_s": self.tail_step_s,
            "carried": sorted(self.carried),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pool.groups = {g.index: g for g in map(Group.from_state, state["groups"])}
        self.pool.to_continue = [(g, i) for g, i in state["to_continue"]]
        self.next_group, self.tail_step_s = state["next_group"], state["tail_step_s"]
        self.carried = {(g, i) for g, i in state["carried"]}


def group_batch(group: Group) -> RolloutBatch:
    return RolloutBatch(group_samples(group), group.params.max_tokens)


def carried_batch(groups: list[Group], max_response_length: int) -> RolloutBatch:
    """The groups' samples in admission order. GRPO groups samples by uid: a prompt drawn again in a later epoch while
    its earlier group was still carried would share it, so a repeated uid is made distinct by its admission index."""
    samples: list[Sample] = []
    seen: Counter[str] = Counter()
    for group in groups:
        uid = group.prompt.row.uid
        seen[uid] += 1
        for sample in group_samples(group):
            if seen[uid] > 1:
                sample.uid = f"{uid}#{group.index}"
            samples.append(sample)
    return RolloutBatch(samples, max_response_length)
