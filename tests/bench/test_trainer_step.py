"""`nonstop bench trainer` on CPU with a tiny model: the timing summary and the report, nonstop's side end to end, and
TRL's side when TRL is installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nonstop.bench import trainer_step
from nonstop.bench.shapes import tiny_config
from nonstop.rollout.step_plan import LaunchShape

sys.path.insert(0, str(Path(__file__).parent.parent / "dist"))
from dist_helpers import spawn  # noqa: E402

TINY = tiny_config(vocab_size=128, tie_word_embeddings=True, attention_bias=True)
TINY_ARGS = ["--prompts", "2", "--n", "2", "--prompt-len", "5", "--response-len", "6", "--warmup", "1", "--steps", "1"]


def test_timing_summary_skips_warmup():
    summary = trainer_step.timed([9.0, 2.0, 1.0, 3.0], warmup=1)
    assert summary["step_s"] == 2.0 and summary["step_s_min"] == 1.0 and summary["step_s_all"] == [9.0, 2.0, 1.0, 3.0]
    with pytest.raises(ValueError, match="all warm-up"):
        trainer_step.timed([1.0], warmup=1)
    rows = [{"timing_s/gen": 1.0, "other": 5.0}, {"timing_s/gen": 3.0, "perf/throughput": 7.0}]
    assert trainer_step.median_metrics(rows, ("timing_s/", "perf/")) == {"perf/throughput": 7.0, "timing_s/gen": 2.0}


def test_table_ratio_and_problems():
    side = {"step_s": 0.5, "throughput": 1000.0, "min_response_length": 256.0}
    ours = {**side, "metrics": {"timing_s/gen": 0.3, "timing_s/ref": 0.0, "perf/throughput": 1100.0}}
    result = {"nonstop": ours, "trl": {**side, "step_s": 6.0, "min_response_length": 200.0}, "speedup": 12.0}
    text = trainer_step.table(result)
    assert "12.0x faster" in text and "gen 0.300" in text and "ref" not in text and "1100 tok/s" in text
    assert trainer_step.problems(result, 256) == [
        "trl: a completion was 200 tokens, not 256: the step times compare different work"
    ]
    failed = {"nonstop": ours, "trl": {"error": "ImportError: no trl"}}
    assert "trl      failed: ImportError: no trl" in trainer_step.table(failed)
    assert trainer_step.problems(failed, 256) == ["trl failed: ImportError: no trl"]


def test_sides_argument():
    assert trainer_step.parser().parse_args([]).sides == ["nonstop", "trl"]
    assert trainer_step.parser().parse_args(["--sides", "trl"]).sides == ["trl"]
    with pytest.raises(SystemExit):
        trainer_step.parser().parse_args(["--sides", "verl"])


def test_nonstop_side_end_to_end(tmp_path):
    args = trainer_step.parser().parse_args([*TINY_ARGS, "--sides", "nonstop"])
    result = trainer_step.run(TINY, args, tmp_path)
    ours = result["nonstop"]
    assert "error" not in ours, ours
    assert ours["min_response_length"] == 6 and len(ours["step_s_all"]) == 2
    assert ours["tokens_per_step"] == 2 * 2 * (5 + 6)
    assert ours["metrics"]["timing_s/gen"] > 0 and ours["metrics"]["timing_s/update_actor"] > 0
    assert ours["metrics"]["rollout/num_engine_steps"] > 0  # the engine's counts per step, for the carry-over's cost
    assert trainer_step.problems(result, 6) == []


def test_trl_side_end_to_end(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    args = trainer_step.parser().parse_args(TINY_ARGS)
    result = trainer_step.run(TINY, args, tmp_path)
    assert trainer_step.problems(result, 6) == [], result
    assert result["trl"]["min_response_length"] == 6 and result["speedup"] > 0


def test_variant_arguments_need_a_name_then_overrides():
    args = trainer_step.parse_args(["--variant", "resident", "a.b=False", "c.d=8", "--variant", "x", "e=1"])
    assert args.variant == [["resident", "a.b=False", "c.d=8"], ["x", "e=1"]]
    for bad in (["--variant", "a.b=False"], ["--variant", "name"], ["--variant", "name", "no_equals"]):
        with pytest.raises(SystemExit):
            trainer_step.parse_args(bad)


def test_a_variant_runs_with_its_overrides_and_reports_ratios(tmp_path):
    # One sequence (5 + 6 tokens) per micro-batch: the variant's overrides reach its trainer.
    small = ["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=11"]
    args = trainer_step.parse_args([*TINY_ARGS, "--sides", "nonstop", "--variant", "small", *small])
    result = trainer_step.run(TINY, args, tmp_path)
    side = result["variants"]["small"]
    assert side["overrides"] == small and len(side["step_s_all"]) == 2
    assert side["metrics"]["actor/num_micro_batches"] == 4 != result["nonstop"]["metrics"]["actor/num_micro_batches"]
    assert side["speedup_vs_nonstop"] == pytest.approx(result["nonstop"]["step_s"] / side["step_s"])
    assert "speedup_vs_trl" not in side  # no TRL side in this run
    assert "small" in trainer_step.table(result) and trainer_step.problems(result, 6) == []


def test_longtail_lengths_against_the_carry_over_report_trained_tokens_per_second(tmp_path):
    """`--response-lengths longtail`: every prompt's length is the bench's log-normal budget (the plain side's
    responses have exactly those lengths); the carry-over variant trains the same kind of work, and the report
    compares trained tokens per second."""
    longtail = ["--response-lengths", "longtail", "--median-response", "3", "--prompts", "4", "--steps", "3"]
    carry = ["actor_rollout_ref.rollout.tail.enable=True", "actor_rollout_ref.rollout.tail.min_running_frac=0.5"]
    args = trainer_step.parse_args([*TINY_ARGS, *longtail, "--sides", "nonstop", "--variant", "carry", *carry])
    result = trainer_step.run(TINY, args, tmp_path)
    plain, side = result["nonstop"], result["variants"]["carry"]
    assert "error" not in plain and "error" not in side, (plain, side)
    assert len(plain["step_s_all"]) == len(side["step_s_all"]) == 1 + 3  # the last, finishing step is not timed
    lengths = plain["metrics"]
    assert 1 <= lengths["response_length/min"] < lengths["response_length/max"] <= 6  # per-prompt, capped
    for s in (plain, side):
        assert s["trained_tokens_per_s"] > 0
    assert side["trained_speedup_vs_nonstop"] == pytest.approx(
        side["trained_tokens_per_s"] / plain["trained_tokens_per_s"]
    )
    assert "tail/num_carried" in side["metrics"] and "tail/num_carried" not in plain["metrics"]
    assert "trained tok/s" in trainer_step.table(result) and trainer_step.problems(result, None) == []
    with pytest.raises(SystemExit):  # TRL cannot follow per-prompt lengths
        trainer_step.parse_args([*TINY_ARGS, *longtail])


@pytest.mark.parametrize("bench", ["trainer", "modes"])
def test_samples_per_prompt_passes_through_torchrun_where_n_cannot(bench):
    """torchrun's parser scans every argument for its own options, script arguments included, and rejects `--n` as
    an ambiguous prefix (--nnodes, --nproc-per-node, ...): the two-GPU scripts spell it --samples-per-prompt."""
    from torch.distributed.run import parse_args as torchrun_args

    from nonstop.bench import modes

    launch = ["--standalone", "--nproc-per-node=2", "-m", "nonstop", "bench", bench, "--prompts", "16"]
    with pytest.raises(SystemExit):
        torchrun_args([*launch, "--n", "8"])
    args = torchrun_args([*launch, "--samples-per-prompt", "8"])
    script_args = args.training_script_args[2:]  # after "bench", bench
    parse = trainer_step.parse_args if bench == "trainer" else modes.parse_args
    assert parse(script_args).n == 8
    assert parse([*script_args[:-2], "--n", "4"]).n == 4  # outside torchrun --n still works


def _write_inputs_on_rank(rank: int, work: str, shared: bool, calls: str) -> None:
    """Counts this rank's model writes (the other inputs follow the same branch)."""
    written = []
    real = trainer_step.write_model_dir
    trainer_step.write_model_dir = lambda *a, **k: written.append(rank) or real(*a, **k)
    args = trainer_step.parser().parse_args([*TINY_ARGS, *(["--work-dir", work] if shared else [])])
    own = Path(work) if shared else Path(work) / f"rank{rank}"
    trainer_step.write_inputs(TINY, args, own)
    assert (own / "model" / "config.json").is_file() and (own / "prompts.jsonl").is_file()  # after the barrier
    (Path(calls) / f"rank{rank}").write_text(str(len(written)))


@pytest.mark.parametrize("shared", [True, False])
def test_ranks_sharing_a_work_dir_write_the_inputs_once(tmp_path, shared):
    calls = tmp_path / "calls"
    calls.mkdir()
    spawn(_write_inputs_on_rank, 2, str(tmp_path / "work"), shared, str(calls))
    counts = [int((calls / f"rank{r}").read_text()) for r in range(2)]
    assert counts == ([1, 0] if shared else [1, 1])


def _failing_writer_on_rank(rank: int, work: str, outcome: str) -> None:
    def broken(*args, **kwargs):
        raise OSError("disk full")

    if rank == 0:
        trainer_step.write_model_dir = broken
    args = trainer_step.parser().parse_args([*TINY_ARGS, "--work-dir", work])
    try:
        trainer_step.write_inputs(TINY, args, Path(work))
        message = "no error"
    except Exception as e:
        message = f"{type(e).__name__}: {e}"
    (Path(outcome) / f"rank{rank}").write_text(message)


def test_a_rank_failing_to_write_the_inputs_fails_every_rank_at_once(tmp_path):
    outcome = tmp_path / "outcome"
    outcome.mkdir()
    spawn(_failing_writer_on_rank, 2, str(tmp_path / "work"), str(outcome))
    assert (outcome / "rank0").read_text() == "OSError: disk full"
    assert "another rank failed to write" in (outcome / "rank1").read_text()


def test_the_ranks_join_with_the_configured_collective_timeout(tmp_path, monkeypatch):
    import nonstop.dist

    seen = []
    monkeypatch.setattr(nonstop.dist, "init_process_group", lambda device_type, timeout_s: seen.append(timeout_s))
    args = trainer_step.parser().parse_args([*TINY_ARGS, "--override", "actor_rollout_ref.nccl_timeout=77"])
    trainer_step.write_inputs(TINY, args, tmp_path)
    assert seen == [77]


def test_the_launch_shapes_each_step_captured_are_listed(tmp_path):
    """A capture costs many decode steps' time, so a bench run lists the CUDA-graph launch shapes each step
    captured: here the engine's graphs are the rollout tests' CPU stand-in, which runs launches eagerly."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "rollout"))
    from test_decode_graphs import EagerReplay

    def plant(trainer):
        runner = trainer.llm.llm_engine.model_runner
        runner.graphs = EagerReplay(runner, runner.max_num_seqs)
        runner.graphs.replayed = []

    args = trainer_step.parser().parse_args([*TINY_ARGS, "--sides", "nonstop", "--steps", "2"])
    trainer_step.write_inputs(TINY, args, tmp_path)
    result = trainer_step.run_nonstop(tmp_path, args, prepare=plant)
    by_step = result["graph_shapes_captured_by_step"]
    assert len(by_step) == 3 and by_step[0] and not by_step[1] and not by_step[2]  # the same shapes after step 1
    assert all(len(shape) == len(LaunchShape._fields) for step in by_step for shape in step)
