"""DAPO dynamic sampling: which groups stay, which metric decides, and a whole step under a planted reward whose
groups are partly all-equal."""

from __future__ import annotations

import functools
import json

import pytest

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.data import PromptRow, TokenizedPrompt
from nonstop.trainer.dynamic_sampling import GroupCollector, kept_group_mask, metric_values


def test_groups_with_equal_values_are_dropped_and_singletons_kept():
    uids = ["a", "a", "b", "b", "c", "d", "d"]
    values = [1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5]
    assert kept_group_mask(uids, values) == [False, False, True, True, True, False, False]


def test_metric_values_by_name():
    rewards, scores = [0.5, -0.25], [1.0, 0.0]
    extras = [{"acc": 1.0, "format": 2.0}, {"acc": 0.0, "format": 3.0}]
    assert metric_values("seq_reward", rewards, scores, extras) == rewards
    assert metric_values("seq_final_reward", rewards, scores, extras) == rewards
    assert metric_values("score", rewards, scores, extras) == scores
    assert metric_values("format", rewards, scores, extras) == [2.0, 3.0]
    assert metric_values("acc", rewards, scores, [{}, {}]) == scores  # a float scorer's score is its acc (verl)
    with pytest.raises(ValueError, match="'length' is not a key"):
        metric_values("length", rewards, scores, extras)


def _batch(uids: list[str], n: int) -> RolloutBatch:
    samples = [Sample([1], [2, 3], [0.0, 0.0], "stop", uid, "src", None) for uid in uids for _ in range(n)]
    return RolloutBatch(samples, 8)


def test_collector_truncates_to_the_batch_size_and_keeps_rounds_apart():
    collector = GroupCollector(train_batch_size=3, n=2)
    first = _batch(["p0", "p1"], 2)
    collector.add(first, [0, 1, 1, 1], [0, 1, 1, 1])  # p1 all-equal
    assert not collector.full()
    second = _batch(["p0", "p2", "p3"], 2)  # p0 drawn again (the loader wrapped)
    collector.add(second, [0, 1, 0, 1, 1, 0], [0, 1, 0, 1, 1, 0])
    assert collector.full()
    batch, rewards = collector.batch(8)
    assert batch.uids == ["p0", "p0", "p0@gen1", "p0@gen1", "p2@gen1", "p2@gen1"]  # p3 is surplus
    assert rewards == [0, 1, 0, 1, 0, 1]
    assert collector.metrics() == {
        "train/num_gen_batches": 2.0,
        "train/num_filtered_groups": 1.0,
        "train/filtered_group_frac": 1 / 5,
    }


# The planted reward: prompts whose number is even score 1 for every response (all-equal groups, filtered); odd
# ones score the response's first token id, which differs within a group of 8 samples at temperature 1 from a
# near-uniform tiny model.
def planted(data_source, solution_str, ground_truth, extra_info=None) -> float:
    if int(ground_truth) % 2 == 0:
        return 1.0
    return float(solution_str.split()[0]) / 32


class NumberedPrompts:
    """`batch_size` prompts per batch with uids p0, p1, ... and the number as ground truth; resumable."""

    def __init__(self, batch_size: int):
        self.batch_size, self.count = batch_size, 0

    def __len__(self) -> int:
        return 1000

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]

    def next_batch(self) -> list[TokenizedPrompt]:
        batch = []
        for _ in range(self.batch_size):
            row = PromptRow(data_source="test/planted", prompt=[], ground_truth=str(self.count), uid=f"p{self.count}")
            batch.append(TokenizedPrompt(row=row, prompt_token_ids=[8 + self.count % 20, 9]))
            self.count += 1
        return batch


DAPO = (
    "data.train_batch_size=3",
    "data.gen_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=3",
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.metric=acc",
    "trainer.total_training_steps=3",
)


@pytest.fixture
def dapo_factory(trainer_factory, monkeypatch):
    import trainer_helpers

    monkeypatch.setattr(trainer_helpers, "FixedPrompts", lambda batch_size, seed: NumberedPrompts(batch_size))
    return functools.partial(trainer_factory, reward_fn=planted)


def test_dynamic_sampling_keeps_the_batch_size_and_reports_the_filtered_fraction(dapo_factory, tmp_path):
    """DAPO dynamic sampling keeps the configured batch size and reports the filtered fraction."""
    trainer = dapo_factory(DAPO, run_dir=tmp_path / "r")
    trained_uids = []
    real_update = trainer.actor.update

    def spy(batch, *args, **kwargs):
        trained_uids.append(batch.uids)
        return real_update(batch, *args, **kwargs)

    trainer.actor.update = spy
    history = trainer.fit()
    n = trainer.config.actor_rollout_ref.rollout.n
    # Each generation batch of 2 prompts holds one odd (kept) and one even (dropped) prompt: 3 kept groups take
    # 3 batches, and half of all generated groups are filtered.
    for uids in trained_uids:
        assert len(uids) == 3 * n
        assert all(int(u.split("@")[0][1:]) % 2 == 1 for u in uids)
    assert [m["train/num_gen_batches"] for m in history] == [3.0, 3.0, 3.0]
    assert [m["train/filtered_group_frac"] for m in history] == [0.5, 0.5, 0.5]
    assert [m["train/num_filtered_groups"] for m in history] == [3.0, 3.0, 3.0]
    assert trainer.train_loader.count == 3 * 3 * 2  # 3 steps x 3 rounds x 2 prompts
    rows = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert [r["train/filtered_group_frac"] for r in rows] == [0.5, 0.5, 0.5]


def test_cap_on_generation_rounds_stops_the_step(dapo_factory, tmp_path):
    trainer = dapo_factory((*DAPO, "algorithm.filter_groups.max_num_gen_batches=2"), run_dir=tmp_path / "r")
    with pytest.raises(RuntimeError, match=r"2 generation batches gave 2 of data.train_batch_size=3 groups"):
        trainer.fit()


def test_resume_after_dynamic_sampling_steps_reproduces_metrics(dapo_factory, tmp_path, monkeypatch):
    from trainer_helpers import comparable

    overrides = (*DAPO, "trainer.total_training_steps=4", "trainer.save_freq=2")
    dapo_factory(overrides, run_dir=tmp_path / "a").fit()
    crashed = dapo_factory(overrides, run_dir=tmp_path / "b")
    real_step = crashed.step

    def crash_at_3(step):
        metrics = real_step(step)
        if step == 3:
            raise RuntimeError("simulated crash")
        return metrics

    monkeypatch.setattr(crashed, "step", crash_at_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    dapo_factory(overrides, run_dir=tmp_path / "b").fit()
    a, b = comparable(tmp_path / "a/metrics.jsonl"), comparable(tmp_path / "b/metrics.jsonl")
    assert [row["step"] for row in b] == [1, 2, 3, 4]
    assert a == b
