"""The carry-over (carry.py) on several data-parallel ranks. Each rank generates its contiguous share of a step's
prompts and continues its own paused groups on its own engine, as colocated sync does; what must hold over all ranks
is decided together:

- the stop: the ranks step their engines in lockstep and sum a few counts after every engine step (`Phase`), so the
  staleness bound, the batch-size rule and the tail of the decode batch are the global batch's;
- equal shares: every rank trains the same number of whole groups, so the finished groups trained are a multiple of
  the ranks. The remainder (at most one fewer than the ranks) is held back: the youngest finished groups by admission
  (never by length), none at its staleness bound, trained in a later step (the next one under the default
  `max_staleness=1`, where it is then due; with a larger bound at the latest when it reaches it);
- the batch: every rank's trained groups are gathered in admission order and the step loop keeps each rank's
  token-balanced share of whole groups (`StepSamples.every_rank`);
- checkpoints: the paused and held-back groups of every rank, one entry per rank (`rank_state` deals them out
  again), a held-back group with the scores it was given when it finished. A checkpoint written before the carry-over
  ran on several ranks reads as one rank's entry (`saved_ranks`).

On one rank every collective is a no-op and the rules are carry.py's own.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

import torch

from nonstop.dist import DistInfo
from nonstop.dist.collectives import all_gather_objects, sum_over_ranks
from nonstop.trainer.sources.groups import Group


@dataclass
class Phase:
    """Counts of a generation phase after an engine step, summed over the ranks."""

    unfinished: int  # ranks whose engine still has requests
    running: int  # sequences decoding (each engine's count capped at its max_num_seqs)
    due: int  # groups at their staleness bound (finished or not)
    due_pending: int  # of those, not finished yet
    done: int  # groups whose n samples have all finished
    carried: int  # sequences the previous stop carried that have not finished yet

    def summed(self, device: torch.device) -> Phase:
        return Phase(*sum_over_ranks(torch.tensor(astuple(self), dtype=torch.int64), device).tolist())


def may_stop(phase: Phase, in_tail: bool, batch_size: int, world_size: int) -> bool:
    """Every due group is done, the groups to hold back for equal shares are not due ones, and either `batch_size`
    groups can be trained or the decode batch is in its tail with at least one group each to train."""
    held = phase.done % world_size
    if phase.due_pending or phase.done - phase.due < held:
        return False
    trainable = phase.done - held
    return trainable >= batch_size or (in_tail and trainable > 0)


def held_back(done: list[Group], due: set[int], world_size: int) -> set[int]:
    """The finished groups (of every rank) this step leaves for the next, so the ranks train equal numbers: the
    youngest not-due ones, `total % world_size` of them. Every rank computes the same set."""
    gathered = all_gather_objects(([g.index for g in done], sorted(g.index for g in done if g.index not in due)))
    total = sum(len(indices) for indices, _ in gathered)
    may_wait = sorted(i for _, not_due in gathered for i in not_due)
    count = total % world_size
    assert len(may_wait) >= count, "the stop rule leaves enough groups that are not due"
    return set(may_wait[len(may_wait) - count :])


def gather_trained(trained: list[tuple[Group, list[float]]]) -> tuple[list[Group], list[float]]:
    """Every rank's trained groups, each with its samples' scores: the groups in admission order, the scores flat."""
    pairs = sorted((pair for part in all_gather_objects(trained) for pair in part), key=lambda pair: pair[0].index)
    return [g for g, _ in pairs], [x for _, scores in pairs for x in scores]


# What a carry-over checkpoint held before it ran on several ranks: one rank's state at the top level, no held scores.
ONE_RANK_KEYS = ("probe_prompts", "groups", "to_continue", "next_group", "tail_step_s", "carried")


def saved_ranks(state: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """A saved carry-over state's admission counter and its entry per rank. One written before several ranks were
    supported is one rank's entry without held-back groups, which it could not have: that code trained every finished
    group in its step, so it saved unfinished ones only. A state that is neither is refused, saying what it lacks."""
    if "ranks" in state:
        return state["next_group"], state["ranks"]
    missing = [k for k in ONE_RANK_KEYS if k not in state]
    if missing:
        raise ValueError(
            f"its carry-over state (actor_rollout_ref.rollout.tail.enable) has no 'ranks' (the layout of several "
            f"ranks) and lacks {missing} of the one-rank layout: it was not written with the carry-over on"
        )
    finished = [g["index"] for g in state["groups"] if all(r is not None for r in g["finish_reasons"])]
    if finished:
        raise ValueError(
            f"its carry-over state (actor_rollout_ref.rollout.tail.enable, one-rank layout) holds finished groups "
            f"{finished} without their scores ('held_scores'); resume from another checkpoint"
        )
    entry = {k: state[k] for k in ONE_RANK_KEYS if k != "next_group"}
    return state["next_group"], [{**entry, "held_scores": []}]


def rank_state(saved: list[dict[str, Any]], dist: DistInfo) -> dict[str, Any]:
    """This rank's part of the paused groups a checkpoint saved on `len(saved)` ranks: its own when resumed on as
    many ranks (exactly the uninterrupted run's); on another number, every group dealt out round robin in admission
    order (a paused group is prefilled again wherever it continues), which needs a number of groups the ranks split
    evenly: each step trains equal shares, and the last one must train every group left."""
    world, rank = dist.world_size, dist.rank
    if len(saved) == world:
        return saved[rank]
    groups = sorted((g for part in saved for g in part["groups"]), key=lambda g: g["index"])
    if len(groups) % world:
        raise ValueError(
            f"this checkpoint holds {len(groups)} unfinished groups carried over (rollout.tail.enable) on "
            f"{len(saved)} rank(s); resume it on {len(saved)} rank(s), or on a number of ranks that divides "
            f"{len(groups)}"
        )
    mine = {g["index"] for g in groups[rank::world]}
    return {
        "probe_prompts": saved[min(rank, len(saved) - 1)]["probe_prompts"],
        "groups": [g for g in groups if g["index"] in mine],
        "to_continue": sorted(p for part in saved for p in part["to_continue"] if p[0] in mine),
        "carried": sorted(p for part in saved for p in part["carried"] if p[0] in mine),
        "held_scores": sorted(p for part in saved for p in part["held_scores"] if p[0] in mine),
        "tail_step_s": sum(part["tail_step_s"] for part in saved) / len(saved),
    }
