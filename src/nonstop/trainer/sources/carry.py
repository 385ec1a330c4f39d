"""`trainer.mode=sync` with `actor_rollout_ref.rollout.tail.enable`: a step's generation never waits for its long
tail. Each step admits its prompts as GRPO groups beside the sequences the previous step left unfinished (continued
first, on the new weights), and stops generating as soon as as many groups as it drew prompts are done, or fewer than
`tail.min_running_frac` of the phase's peak decode batch still runs, whichever comes first; what is still generating
is paused (aborted: KV released, tokens, log-probs and policy versions kept, groups.py) and carried into the next
step. The step trains every group whose n samples have all finished, in admission order (never shortest first).

Never drop, never bias: a group admitted `tail.max_staleness` versions ago is finished before the step may stop, so
no trained sample is older than the bound; the last step finishes everything, so every started sample is trained
exactly once. Tokens of older versions are corrected against their recorded log-probs by the update's token-level
importance sampling (`algorithm.rollout_correction`). The paused groups are part of the checkpoint. On several ranks
the stop, the shares and the checkpoint are decided over all of them (carry_ranks.py). APRIL (slime) and verl's
partial rollouts are the published forms; docs/modes.md says when it pays.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from typing import Any

import torch

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.batching.rank_shares import rank_share
from nonstop.config import NonstopConfig
from nonstop.dist import DistInfo
from nonstop.dist.collectives import all_gather_objects
from nonstop.profiling import PhaseRecorder
from nonstop.trainer.scores import group_prefix
from nonstop.trainer.sources.base import SourceBase, StepSamples, loader_state
from nonstop.trainer.sources.batch_fill import BatchFill
from nonstop.trainer.sources.carry_ranks import Phase, gather_trained, held_back, may_stop, rank_state, saved_ranks
from nonstop.trainer.sources.generation import EngineGeneration, copy_to_engine
from nonstop.trainer.sources.groups import Group, GroupRequests
from nonstop.trainer.sources.overlap import group_samples, staleness_metrics

# Engine steps before a stop whose mean wall time prices the tail the stop skipped (`tail/gen_time_saved_s`).
TAIL_STEPS_TIMED = 8


class CarrySource(SourceBase):
    publishes_every_step = False
    old_log_prob_from_rollout = False

    def __init__(
        self, config: NonstopConfig, generation: EngineGeneration, train_loader: Any, total_steps: int, dist: DistInfo
    ):
        self.config, self.generation, self.train_loader = config, generation, train_loader
        self.total_steps, self.dist = total_steps, dist
        self.tail = config.actor_rollout_ref.rollout.tail
        self.scorer = generation.scorer
        self.pool = GroupRequests(generation.llm, self._score)
        self.next_group = 0  # admission counter over the run, over all ranks
        # The last stop's price of a skipped tail step, and the carried sequences whose finishing steps it prices.
        self.tail_step_s = 0.0
        self.carried: set[tuple[int, int]] = set()
        self.held_scores: dict[int, list[float]] = {}  # finished groups held back for equal shares: their scores

    def _score(self, group: Group) -> None:
        self.scorer.submit(group_prefix(group.index), 0, group_samples(group))

    def next_batch(self, step: int, rec: PhaseRecorder) -> StepSamples:
        generation, version = self.generation, step - 1
        with rec("data"):
            first, prompts = rank_share(self.train_loader.next_batch(), self.dist)
        self.remember_probe([p.prompt_token_ids for p in prompts])
        metrics: dict[str, float] = {}
        with rec("gen") as span:
            with generation.engine_turn():
                if self.probe_prompts and not generation.shares_weights:
                    metrics["actor/sync_logprob_diff"] = generation.probe(self.probe_prompts, step)
                self.pool.version = version
                gen_metrics, due = self._generate(step, prompts, first)
                metrics.update(gen_metrics)
            done = [g for _, g in sorted(self.pool.groups.items()) if g.done]
            held = held_back(done, due, self.dist.world_size)
            groups = [self.pool.groups.pop(g.index) for g in done if g.index not in held]
            span.tokens = sum(sum(len(g.prompt.prompt_token_ids) + len(t) for t in g.token_ids) for g in groups)
        with rec("reward"):
            for g in done:  # each finished group's scores collected once; a held-back group keeps them
                if g.index not in self.held_scores:
                    self.held_scores[g.index] = self.scorer.collect(group_batch(g), group_prefix(g.index))[0].tolist()
            groups, scores = gather_trained([(g, self.held_scores.pop(g.index)) for g in groups])
            batch = carried_batch(groups, generation.sampling.train.max_tokens)
            rewards_B = torch.tensor(scores, dtype=torch.float32) + self.scorer.shaping(batch)
        metrics.update(staleness_metrics(batch, version, self.tail.max_staleness, prefix="tail/staleness"))
        metrics["tail/num_groups"] = float(len(groups))
        metrics["tail/num_held_back"] = float(len(held))
        metrics.update(self.scorer.shaping_metrics(batch))
        return StepSamples(batch, rewards_B, metrics, every_rank=True)

    def _generate(self, step: int, prompts: list, first: int) -> tuple[dict[str, float], set[int]]:
        """Continue the carried sequences, admit `prompts` (this rank's share, from prompt `first` of the step on),
        step the engine until the stop rule holds over all ranks, pause the rest; the phase's `rollout/*` and
        `tail/*` metrics and the groups at their staleness bound."""
        pool, llm, version, world = self.pool, self.generation.llm, step - 1, self.dist.world_size
        continued = len(pool.to_continue)
        pool.continue_all()  # first: the engine queues in arrival order, oldest group first
        seeded = self.generation.sampling.seeded(list(prompts), self.generation.sampling.train, step, first)
        for i, (prompt, params) in enumerate(zip(prompts, seeded, strict=True)):
            pool.admit(Group.new(self.next_group + first + i, prompt, params, version))
        self.next_group += len(prompts) * world
        # Groups at the staleness bound must finish now; the last step finishes everything.
        last = step == self.total_steps
        due = {
            g for g, group in pool.groups.items() if last or version - group.admitted_version >= self.tail.max_staleness
        }
        fill = BatchFill(llm.max_num_seqs * world, self.tail.min_running_frac)
        window = llm.stats_window()
        step_times: list[float] = []
        carried_steps = 0  # engine steps until the sequences the last stop carried had all finished
        try:
            while True:
                phase = self._phase(due).summed(self.generation.actor.device)
                fill.observe(phase.running)
                if not phase.unfinished or may_stop(phase, fill.in_tail, len(prompts) * world, world):
                    break
                carried_steps += bool(phase.carried)
                if not llm.has_unfinished_requests():
                    continue  # this rank is done; the others still generate
                start = time.perf_counter()
                for output in llm.step():
                    pool.record(output)
                step_times.append(time.perf_counter() - start)
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
        tokens = sum(len(pool.groups[g].token_ids[i]) for g, i in paused)
        totals = [sum(c) for c in zip(*all_gather_objects((continued, len(paused), tokens)), strict=True)]
        metrics.update(
            {
                "tail/num_continued": float(totals[0]),
                "tail/num_carried": float(totals[1]),
                "tail/carried_tokens": float(totals[2]),
                "tail/batch_fill/mean": fill.mean,
                "tail/stopped_early": float(totals[1] > 0),
            }
        )
        return metrics, due

    def _phase(self, due: set[int]) -> Phase:
        """This rank's counts after an engine step."""
        groups, llm = self.pool.groups, self.generation.llm
        return Phase(
            unfinished=int(llm.has_unfinished_requests()),
            running=min(self.pool.num_in_engine(), llm.max_num_seqs),
            due=len(due),
            due_pending=sum(not groups[g].done for g in due),
            done=sum(g.done for g in groups.values()),
            carried=len(self.carried),
        )

    def publish_weights(self, version: int) -> None:
        copy_to_engine(self.generation.model, self.generation.llm)

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return self.generation.kv.step_metrics(metrics)

    def paused(self) -> nullcontext:
        return nullcontext()  # the engine only runs inside `next_batch`; carried groups wait outside it

    def loader_state(self, step: int) -> dict[str, Any] | None:
        return loader_state(self.train_loader)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's paused groups (every admitted group not yet trained; a collective: rank 0 writes the
        checkpoint), its probe prompts and time estimate, and where admission is."""
        mine = {
            **super().state_dict(),
            "groups": [g.state_dict() for g in self.pool.groups.values()],
            "to_continue": self.pool.to_continue,
            "tail_step_s": self.tail_step_s,
            "carried": sorted(self.carried),
            "held_scores": sorted(self.held_scores.items()),
        }
        return {"next_group": self.next_group, "ranks": all_gather_objects(mine)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        next_group, ranks = saved_ranks(state)
        mine = rank_state(ranks, self.dist)
        super().load_state_dict(mine)
        self.pool.groups = {g.index: g for g in map(Group.from_state, mine["groups"])}
        self.held_scores = {g: scores for g, scores in mine["held_scores"]}
        self.pool.to_continue = [(g, i) for g, i in mine["to_continue"]]
        self.next_group, self.tail_step_s = next_group, mine["tail_step_s"]
        self.carried = {(g, i) for g, i in mine["carried"]}


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
