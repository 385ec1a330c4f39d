"""The console's live view of a run (trainer/progress.py): a line per stage of the build, then the bar's phase names
and what each long phase is at — generated tokens and running samples, micro-batch k/K, rewards pending — throttled
in the engine's loop, and nothing at all without the console."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from trainer_helpers import FixedPrompts, IdTokenizer, seven_fraction, slow_seven_fraction, tiny_model, tiny_run_config

import nonstop.rewards.pool as pool_module
import nonstop.rollout.progress as rollout_progress
from nonstop.rewards import RewardPool
from nonstop.rollout.progress import GenerationProgress
from nonstop.rollout.scheduled import SchedulerStats
from nonstop.trainer import build
from nonstop.trainer.progress import ProgressBar, show_progress


class RecordingBar:
    """tqdm's surface that ProgressBar uses, recording the postfixes shown."""

    shown: list[str] = []

    def __init__(self, total, initial, desc, unit):
        self.n = initial

    def set_postfix_str(self, text):
        RecordingBar.shown.append(text)

    def write(self, line):
        pass

    def update(self, k):
        self.n += k

    def close(self):
        pass


@pytest.fixture
def shown(monkeypatch) -> list[str]:
    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", RecordingBar)
    RecordingBar.shown = []
    return RecordingBar.shown


def test_the_progress_bar_names_each_phase_as_it_starts(trainer_factory, tmp_path, shown):
    overrides = ("trainer.total_training_steps=1", "trainer.val_before_train=True", "trainer.test_freq=-1")
    trainer = trainer_factory(overrides, run_dir=tmp_path / "r", validate=True)
    show_progress(trainer, ProgressBar())
    trainer.fit()
    assert shown[0] == "validation 1/1"
    assert [p for p in ("gen", "reward", "update_actor") if p in shown] == ["gen", "reward", "update_actor"]
    assert shown.index("gen") < shown.index("update_actor")
    # The step-0 validation's generation is shown under its batch's name.
    assert any(re.fullmatch(r"validation 1/1 [\d,]+ tok, \d+/8 running", text) for text in shown)


def matches(pattern: str, shown: list[str]) -> list[tuple[int, ...]]:
    return [tuple(int(g.replace(",", "")) for g in m.groups()) for t in shown if (m := re.fullmatch(pattern, t))]


def test_a_step_shows_generated_tokens_micro_batches_and_pending_rewards(trainer_factory, shown, monkeypatch):
    monkeypatch.setattr(rollout_progress, "PROGRESS_INTERVAL_S", 0.0)  # every engine step: the whole sequence
    monkeypatch.setattr(pool_module, "PROGRESS_INTERVAL_S", 0.01)
    overrides = ("trainer.total_training_steps=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    trainer = trainer_factory(overrides, reward_fn=slow_seven_fraction, reward_workers=1)
    show_progress(trainer, ProgressBar())
    (metrics,) = trainer.fit()
    num_samples = 4 * 8

    gen = matches(r"gen ([\d,]+) tok, (\d+)/(\d+) running", shown)
    tokens = [t for t, _, _ in gen]
    assert len(gen) > 2 and tokens == sorted(tokens) and tokens[0] < tokens[-1]
    assert all(total == num_samples and 0 <= running <= total for _, running, total in gen)
    assert max(running for _, running, _ in gen) > 0
    assert gen[-1][:2] == (round(metrics["response_length/mean"] * num_samples), 0)  # every response token, none left

    update = matches(r"update_actor (\d+)/(\d+)", shown)
    num_micro_batches = int(metrics["actor/num_micro_batches"])
    assert num_micro_batches == 4
    assert update == [(k, num_micro_batches) for k in range(1, num_micro_batches + 1)]

    pending = matches(r"reward (\d+)/(\d+) pending", shown)
    assert pending and all(total == num_samples for _, total in pending)
    counts = [n for n, _ in pending]
    assert counts == sorted(counts, reverse=True) and 0 < counts[0] <= num_samples
    assert shown.index(f"reward {pending[-1][0]}/{num_samples} pending") < shown.index("adv")  # then the phase ends


def test_the_generation_line_is_formatted_at_most_once_per_interval():
    now = [0.0]
    stats = SchedulerStats()
    scheduler = SimpleNamespace(stats=stats, running=[SimpleNamespace(num_samples=4), SimpleNamespace(num_samples=1)])
    lines = []
    progress = GenerationProgress(lines.append, scheduler, num_samples=8, interval_s=0.5, clock=lambda: now[0])
    for _ in range(25):  # 2.5 s of 0.1 s engine steps
        progress.tick()
        stats.num_generated_tokens += 1000
        now[0] += 0.1
    assert len(lines) == 5  # at 0.0, 0.5, 1.0, 1.5, 2.0 s
    assert lines[0] == "0 tok, 5/8 running"
    assert lines[1] == "5,000 tok, 5/8 running"


def test_nothing_is_shown_or_computed_without_the_console(trainer_factory, monkeypatch, capsys):
    def no_line(*args, **kwargs):
        raise AssertionError("a progress line was made without the console")

    monkeypatch.setattr("nonstop.rollout.llm.GenerationProgress", no_line)
    monkeypatch.setattr(pool_module, "PROGRESS_INTERVAL_S", 0.01)
    trainer = trainer_factory(
        ("trainer.total_training_steps=1",), reward_fn=slow_seven_fraction, reward_workers=1, validate=True
    )
    assert trainer.log.progress is None
    assert trainer.profiler.recorder.on_open is None
    assert [p.progress for p in (trainer.generation, trainer.actor, trainer.scorer)] == [None, None, None]
    trainer.fit()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_building_a_run_prints_a_line_per_stage_before_the_first_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build, "load_policy", lambda config, dtype, device: (tiny_model(), IdTokenizer()))
    monkeypatch.setattr(build, "train_dataloader", lambda data, tokenizer: FixedPrompts(4))
    monkeypatch.setattr(build, "val_dataloader", lambda data, tokenizer: None)
    monkeypatch.setattr(build, "reward_pool", lambda config: RewardPool(seven_fraction, num_workers=0))
    overrides = ("trainer.total_training_steps=1", "trainer.device=cpu", "actor_rollout_ref.rollout.max_model_len=16")
    config = tiny_run_config(tmp_path / "r", overrides)
    trainer = build.build_trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.close()
    lines = capsys.readouterr().out.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1 |"))
    # model.path=null is the embedded default model, named by its file
    assert re.fullmatch(r"loading the policy from /\S+/SmolLM2-135M-Instruct\.Q4_1\.gguf on cpu", lines[0]), lines[0]
    assert lines[1:first_step] == [
        "building the rollout engine (its weights and KV cache)",
        "loading the data",
        "starting the reward workers",
    ]
