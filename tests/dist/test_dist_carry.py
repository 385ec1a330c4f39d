"""The carry-over of unfinished responses (`actor_rollout_ref.rollout.tail.*`, sources/carry_ranks.py) on two gloo
ranks: over many steps every started sample is trained exactly once, within the staleness bound, each rank training
as many whole groups; a run resumed from a checkpoint taken while sequences were carried reproduces the
uninterrupted two-rank run's metrics. Also the stop rule's arithmetic and the dealing of a checkpoint's paused
groups over another number of ranks, by hand."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from dist_helpers import spawn

sys.path.insert(0, str(Path(__file__).parent.parent / "trainer"))
from test_async_trainer import _record_batches  # noqa: E402
from test_carry import CARRY, long_tailed  # noqa: E402
from trainer_helpers import comparable, make_trainer  # noqa: E402

from nonstop.dist import DistInfo  # noqa: E402
from nonstop.trainer.sources.carry_ranks import Phase, held_back, may_stop, rank_state  # noqa: E402

STEPS, SAVE, BATCH, N = 12, 4, 4, 8
OVERRIDES = (f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={SAVE}", *CARRY)


class Crash(Exception):
    pass


def carry_worker(rank: int, root: str) -> None:
    """Rank `rank` of: an uninterrupted run (run `a`, its trained samples recorded), and a run that stops right
    after step SAVE + 1 and resumes from the checkpoint of step SAVE (run `b`)."""
    root_dir = Path(root)
    trainer = long_tailed(make_trainer(root_dir / "a", OVERRIDES, engine_copy=True, shard=True))
    batches = _record_batches(trainer)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    trained = [[(s.uid, s.token_policy_versions) for s in batch.samples] for batch in batches]
    (root_dir / f"a_rank{rank}.json").write_text(json.dumps({"trained": trained, "history": history}))

    crashed = long_tailed(make_trainer(root_dir / "b", OVERRIDES, engine_copy=True, shard=True))
    real_step = crashed.step

    def crash_after(step: int) -> dict[str, float]:
        metrics = real_step(step)
        if step == SAVE + 1:
            raise Crash
        return metrics

    crashed.step = crash_after
    try:
        with pytest.raises(Crash):
            crashed.fit()
    finally:
        crashed.close()
    resumed = long_tailed(make_trainer(root_dir / "b", OVERRIDES, engine_copy=True, shard=True))
    try:
        steps = [m["training/global_step"] for m in resumed.fit()]
    finally:
        resumed.close()
    (root_dir / f"b_rank{rank}.json").write_text(json.dumps(steps))


def test_two_ranks_train_every_sample_once_and_resume_exactly(tmp_path):
    spawn(carry_worker, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"a_rank{r}.json").read_text()) for r in range(2)]
    history = ranks[0]["history"]
    assert ranks[1]["history"] == history  # metrics reduced over the ranks
    assert all(len(r["trained"]) == STEPS for r in ranks)
    trained = Counter()
    for step in range(STEPS):  # step + 1 trains on policy version `step`
        shares = [r["trained"][step] for r in ranks]
        assert len(shares[0]) == len(shares[1]) > 0  # as many samples, so as many whole groups, on each rank
        for share in shares:
            counts = Counter(uid for uid, _ in share)
            assert set(counts.values()) == {N}  # whole groups
            trained.update(counts)
            for _, versions in share:
                assert max(versions) <= step and step - min(versions) <= 1  # tail.max_staleness=1
    # Every prompt the loader gave, its n samples, once over both ranks: nothing lost, nothing duplicated.
    assert trained == {f"p{i}": N for i in range(STEPS * BATCH)}
    assert history[SAVE - 1]["tail/num_carried"] > 0  # the checkpoint holds paused sequences
    assert sum(m["tail/num_held_back"] for m in history) > 0  # an odd number of groups finished at some stop
    assert max(m["tail/staleness/max"] for m in history) == 1
    assert history[-1]["tail/num_carried"] == 0  # the last step finishes everything
    for before, after in zip(history, history[1:], strict=False):
        assert after["tail/num_continued"] == before["tail/num_carried"]

    assert json.loads((tmp_path / "b_rank0.json").read_text()) == [float(s) for s in range(SAVE + 1, STEPS + 1)]
    a, b = comparable(tmp_path / "a/metrics.jsonl"), comparable(tmp_path / "b/metrics.jsonl")
    assert len(a) == len(b) == STEPS
    differing = sorted(
        {k for ra, rb in zip(a, b, strict=True) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
    )
    assert not differing, differing


@pytest.mark.parametrize(
    "phase, in_tail, batch_size, expected",
    [
        (Phase(1, 4, due=2, due_pending=0, done=5, carried=0), False, 4, True),  # 4 trained, 1 not-due held back
        (Phase(1, 4, due=3, due_pending=0, done=3, carried=0), True, 4, False),  # the one to hold back would be due
        (Phase(1, 4, due=2, due_pending=1, done=6, carried=0), True, 4, False),  # a due group still runs
        (Phase(1, 1, due=0, due_pending=0, done=3, carried=0), True, 8, True),  # in the tail: 2 trained
        (Phase(1, 1, due=0, due_pending=0, done=1, carried=0), True, 8, False),  # in the tail, but none to train
        (Phase(1, 9, due=0, due_pending=0, done=3, carried=0), False, 4, False),  # 2 trainable, not the tail
    ],
)
def test_the_stop_waits_for_equal_shares_on_two_ranks(phase, in_tail, batch_size, expected):
    assert may_stop(phase, in_tail, batch_size, world_size=2) == expected


def test_a_held_back_group_may_wait_again_until_it_is_due():
    """On one process `held_back` sees every finished group as if gathered from two ranks."""
    done = lambda *indices: [SimpleNamespace(index=i) for i in indices]  # noqa: E731  (held_back reads the index)
    assert held_back(done(4, 5, 6), due=set(), world_size=2) == {6}  # the youngest of an odd count
    assert held_back(done(6), due=set(), world_size=2) == {6}  # not due yet (tail.max_staleness > 1): held again
    assert held_back(done(6, 7, 8), due={6}, world_size=2) == {8}  # due: trained, a younger one waits instead


def saved_on_two_ranks() -> list[dict]:
    group = lambda index: {"index": index}  # noqa: E731  (rank_state reads only the index)
    return [
        {"probe_prompts": [[1]], "groups": [group(0), group(3)], "to_continue": [[3, 1]], "carried": [[3, 1]],
         "held_scores": [], "tail_step_s": 0.25},
        {"probe_prompts": [[2]], "groups": [group(2), group(5)], "to_continue": [[5, 0], [5, 2]], "carried": [],
         "held_scores": [[2, [0.5, 1.0]]], "tail_step_s": 0.75},
    ]  # fmt: skip


def test_paused_groups_are_dealt_out_over_another_number_of_ranks():
    saved = saved_on_two_ranks()
    assert rank_state(saved, DistInfo(rank=1, world_size=2)) is saved[1]  # as many ranks: its own, exactly
    one = rank_state(saved, DistInfo(rank=0, world_size=1))
    assert [g["index"] for g in one["groups"]] == [0, 2, 3, 5]
    assert one["to_continue"] == [[3, 1], [5, 0], [5, 2]] and one["carried"] == [[3, 1]]
    assert one["held_scores"] == [[2, [0.5, 1.0]]] and one["tail_step_s"] == 0.5 and one["probe_prompts"] == [[1]]
    fourth = rank_state(saved, DistInfo(rank=3, world_size=4))  # groups 0, 2, 3, 5 dealt one each, in order
    assert [g["index"] for g in fourth["groups"]] == [5] and fourth["to_continue"] == [[5, 0], [5, 2]]
    with pytest.raises(ValueError, match="holds 4 unfinished groups"):
        rank_state(saved, DistInfo(rank=0, world_size=3))
