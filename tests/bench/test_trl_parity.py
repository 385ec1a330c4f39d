"""`nonstop bench trl-parity` on CPU with a tiny model: the matched settings read back from nonstop's resolved config
and TRL's `GRPOConfig`, what cannot be matched refused, both sides run end to end on the same prompts in the same
order, the runner's processes overlap and stop at the deadline, and the report's checks by hand."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import pytest
import torch
from test_trainer_step import TINY

from nonstop.bench import trainer_inputs
from nonstop.bench.trl_parity import cli, report
from nonstop.bench.trl_parity.inputs import Task, identity, prepare_model, train_order
from nonstop.bench.trl_parity.plan import Plan, validation_steps
from nonstop.bench.trl_parity.settings import check_matchable, grpo_kwargs, matched_pairs
from nonstop.data import read_rows
from nonstop.profiling.timeline import read_jsonl

trl = pytest.importorskip("trl")

# transformers loads the word tokenizer beside a llama config; llama's attention_bias would add an o_proj bias
LLAMA_TINY = replace(TINY, model_type="llama", attention_bias=False)
ARGS = ["--steps", "2", "--prompts", "2", "--n", "2", "--response-len", "4", "--test-freq", "2", "--seeds", "0,1"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A work directory prepared for a tiny task: 8 prompts of random words, the pseudo-random reward."""
    work = tmp_path_factory.mktemp("trl_parity")
    trainer_inputs.write_model_dir(LLAMA_TINY, work / "source", torch.device("cpu"))
    pool = read_rows(trainer_inputs.write_prompts(work / "pool.jsonl", trainer_inputs.prompt_texts(8, 5, 128)))
    reward = trainer_inputs.write_reward_fn(work / "reward.py")
    task = Task("tiny", pool, pool[:2], max_prompt_length=16, reward_path=str(reward))
    args = cli.parse_args([*ARGS, "--model", str(work / "source"), "--work-dir", str(work)])
    return cli.prepare(args, work, task), work, pool


def grpo_config(plan: Plan, work, **kwargs):
    config = plan.config(0, work / "runs" / "check", tuple(f"{k}={v}" for k, v in kwargs.items()))
    return config, trl.GRPOConfig(**grpo_kwargs(config, str(work / "trl_check"), cuda=False))


def test_the_same_model_and_prompts_on_both_sides(planned):
    plan, _, pool = planned
    found = plan.identity
    assert found["parameters_differing"] == [] and found["prompts_differing"] == 0 and found["prompts"] == 10
    assert found["nonstop_stop_token_ids"] == found["trl_eos_token_ids"] == [1]
    assert found["first_prompt_logits_max_abs_diff"] < 1e-5


def test_a_model_transformers_reads_differently_is_refused(tmp_path, planned):
    _, _, pool = planned
    # transformers' llama with attention_bias also has an o_proj bias, which nonstop's model has no place for.
    trainer_inputs.write_model_dir(replace(TINY, model_type="llama"), tmp_path / "source", torch.device("cpu"))
    model_dir = prepare_model(str(tmp_path / "source"), tmp_path / "model")
    with pytest.raises(ValueError, match="o_proj.bias"):
        identity(model_dir, pool)


def test_each_seed_has_its_own_order_of_the_pool_epoch_after_epoch(planned):
    plan, _, pool = planned
    orders = [read_rows(plan.train_files[str(seed)]) for seed in (0, 1)]  # 2 steps x 2 prompts each
    prompts = [[str(row.prompt) for row in rows] for rows in orders]
    assert len(prompts[0]) == 4 and prompts[0] != prompts[1] and len(set(prompts[0])) == 4
    assert set(prompts[0]) <= {str(row.prompt) for row in pool}
    assert [row.extra_info["position"] for row in orders[0]] == [0, 1, 2, 3]
    rows = train_order(pool, 20, seed=3)  # 8 prompts: two whole epochs, then 4 of a third
    epochs = [sorted(str(r.prompt) for r in rows[i : i + 8]) for i in (0, 8)]
    assert epochs[0] == epochs[1] == sorted(str(r.prompt) for r in pool) and [r.prompt for r in rows[:8]] != [
        r.prompt for r in rows[8:16]
    ]
    assert [r.extra_info["position"] for r in rows] == list(range(20)) and train_order(pool, 20, seed=3) == rows


def test_matched_settings_read_back_equal_from_both_configs(planned):
    plan, work, _ = planned
    config, grpo = grpo_config(plan, work)
    rows = matched_pairs(config, grpo)
    assert rows and all(row["equal"] for row in rows), [r for r in rows if not r["equal"]]
    # The pairs by hand: one generation batch of 2 prompts x 2 samples is one optimizer step, token-mean = dapo.
    assert (grpo.generation_batch_size, grpo.num_generations, grpo.steps_per_generation) == (4, 2, 1)
    assert (grpo.per_device_train_batch_size, grpo.gradient_accumulation_steps, grpo.num_iterations) == (4, 1, 1)
    assert (grpo.loss_type, grpo.scale_rewards, grpo.beta) == ("dapo", "group", 0.0)
    assert (grpo.max_completion_length, grpo.max_steps, grpo.learning_rate) == (4, 2, 1e-5)
    assert (grpo.top_k, grpo.top_p, grpo.temperature, grpo.shuffle_dataset) == (0, 1.0, 1.0, False)
    assert (config.actor_rollout_ref.actor.loss_agg_mode, config.data.shuffle) == ("token-mean", False)


def test_other_loss_schedule_and_micro_batches_follow_nonstop(planned):
    plan, work, _ = planned
    config, grpo = grpo_config(
        plan,
        work,
        **{
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
            "algorithm.norm_adv_by_std_in_grpo": False,
            "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
            "actor_rollout_ref.actor.optim.lr_warmup_steps": 1,
        },
    )
    assert all(row["equal"] for row in matched_pairs(config, grpo))
    assert (grpo.loss_type, grpo.scale_rewards, grpo.lr_scheduler_type.value, grpo.warmup_steps) == (
        "grpo",
        "none",
        "cosine",
        1,
    )
    micro = trl.GRPOConfig(**grpo_kwargs(config, str(work / "trl_micro"), cuda=False, micro_batch=2))
    assert (micro.per_device_train_batch_size, micro.gradient_accumulation_steps, micro.steps_per_generation) == (
        2,
        2,
        2,
    )
    assert all(row["equal"] for row in matched_pairs(config, micro))


@pytest.mark.parametrize(
    "key, value",
    [
        ("actor_rollout_ref.actor.optim.weight_decay", "0.01"),
        ("actor_rollout_ref.actor.use_kl_loss", "True"),
        ("actor_rollout_ref.actor.ppo_epochs", "2"),
        ("actor_rollout_ref.actor.loss_agg_mode", "seq-mean-token-sum-norm"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "1"),
        ("trainer.mode", "async"),
        ("data.shuffle", "True"),
    ],
)
def test_what_trl_cannot_reproduce_is_refused_by_key(planned, key, value):
    plan, work, _ = planned
    config = plan.config(0, work / "runs" / "check", (f"{key}={value}",))
    with pytest.raises(ValueError, match=key.split(".")[-1]):
        check_matchable(config)


def test_both_sides_train_on_the_same_prompts_and_validate_alike(planned):
    from nonstop.bench.trl_parity.sides import run_one

    plan, work, _ = planned
    for side in ("nonstop", "trl"):
        run_one(work, side, 0)
    rows = {side: read_jsonl(work / "runs" / f"{side}-0" / "metrics.jsonl") for side in ("nonstop", "trl")}
    trained = {side: [r for r in rs if "critic/score/mean" in r] for side, rs in rows.items()}
    assert [r["step"] for r in trained["nonstop"]] == [r["step"] for r in trained["trl"]] == [1, 2]
    assert [r["prompt_positions"] for r in trained["trl"]] == [[0, 1], [2, 3]]  # the file's order, 2 a step
    assert [r["actor/lr"] for r in trained["trl"]] == [r["actor/lr"] for r in trained["nonstop"]]
    key = "val/bench/random/score"
    validated = {side: {r["step"]: r[key] for r in rs if key in r} for side, rs in rows.items()}
    assert sorted(validated["trl"]) == sorted(validated["nonstop"]) == validation_steps(plan.config(0, work)) == [0, 2]
    assert validated["trl"][0] == validated["nonstop"][0]  # the same starting model, validated the same way
    assert not (work / "runs" / "trl-0" / "checkpoints" / "step_2").exists()
    curves = report.load_curves(work, plan, samples_per_step=4)
    assert [p["samples"] for p in curves["trl"][0]] == [0, 4, 8]
    assert curves["trl"][0][-1]["train_s"] == pytest.approx(sum(r["timing_s/step"] for r in trained["trl"]))


def _sleeper(stamps):
    def command(work, side, seed, alone):
        code = f"import time; open({str(stamps / f'{side}{seed}')!r}, 'w').write(str(time.time())); time.sleep(2)"
        return [sys.executable, "-c", code]

    return command


def test_runs_overlap_up_to_jobs_and_stop_at_the_deadline(tmp_path):
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    runs = [("nonstop", 0, False), ("trl", 0, False), ("nonstop", 1, False)]
    status = cli.launch(runs, tmp_path, jobs=2, deadline=None, command=_sleeper(stamps))
    assert all(s["rc"] == 0 for s in status.values()) and len(status) == 3
    started = sorted(float((stamps / name).read_text()) for name in ("nonstop0", "trl0", "nonstop1"))
    assert started[1] - started[0] < 1.5 <= started[2] - started[0]  # two at once, the third when one ends
    status = cli.launch(runs, tmp_path, jobs=1, deadline=time.time() + 1.0, command=_sleeper(stamps))
    assert status["nonstop-0"]["rc"] != 0  # terminated
    assert status["trl-0"]["rc"] is None and status["nonstop-1"]["rc"] is None  # never started


def _points(rewards, step_s=1.0):
    return [{"step": i + 1, "samples": 4 * (i + 1), "reward": r, "step_s": step_s, "train_s": step_s * (i + 1)}
            for i, r in enumerate(rewards)]  # fmt: skip


def test_checks_by_hand():
    ours = {0: _points([0.1, 0.5, 0.6, 0.7]), 1: _points([0.3, 0.5, 0.8, 0.7])}
    theirs = {0: _points([0.2, 0.3, 0.5, 0.6], 10.0), 1: _points([0.2, 0.5, 0.5, 0.8], 10.0)}
    result = report.compare({"nonstop": ours, "trl": theirs}, {}, last=2)
    # Last two steps: nonstop seeds 0.65, 0.75 (mean 0.70); TRL 0.55, 0.65 (mean 0.60, std 0.0707).
    check = result["check_last_steps"]
    assert check["nonstop"] == pytest.approx(0.70) and check["trl"] == pytest.approx(0.60)
    assert check["trl_std"] == pytest.approx(0.0707107) and check["passed"]
    # Step means / stds: nonstop (0.2, .141) (0.5, 0) (0.7, .141) (0.7, 0); TRL (0.2, 0) (0.4, .141) (0.5, 0)
    # (0.7, .141): the bands meet at steps 1, 2 (0.5 vs 0.4 + 0.141) and 4, not at 3 (0.7 - 0.141 > 0.5).
    assert result["check_overlap"] == {"steps": 4, "overlapping": 3, "passed": False}
    # TRL's final reward 0.60: trailing 5-step means of nonstop 0.2, 0.35, 0.467, 0.525 never reach it; TRL's
    # 0.2, 0.3, 0.367, 0.45 neither.
    assert result["time_to_trl_final_reward"]["concurrent"] == {"nonstop_s": None, "trl_s": None, "ratio": None}
    rows = [{"mean": m, "train_s": t} for m, t in ((0.2, 1.0), (0.9, 2.0), (0.9, 3.0))]
    assert report.time_to_reach(rows, 0.6, window=2) == 3.0  # (0.2 + 0.9) / 2 = 0.55; (0.9 + 0.9) / 2 = 0.9
    assert report.step_time(ours) == 1.0 and report.step_time(theirs) == 10.0
    first = result["first_step"]["nonstop"]["reward"]
    assert [(r["step"], r["mean"]) for r in first] == [(1, pytest.approx(0.2))]
    text = report.table(result, last=2)
    assert "FAIL" in text and "TRL / nonstop 10.0x" in text
    assert json.loads(json.dumps(result)) == result


def test_runs_sharing_a_gpu_get_a_fixed_micro_batch_budget(planned):
    """With --jobs > 1 nonstop's update must not size its micro-batches from the free memory the other runs need;
    the settings still match TRL's (micro-batching changes the float order, not the sums)."""
    plan, work, pool = planned
    task = Task("tiny", pool, pool[:2], max_prompt_length=16)
    alone = cli.nonstop_overrides(cli.parse_args([*ARGS, "--jobs", "1"]), work / "m", work / "v.jsonl", task)
    shared = cli.nonstop_overrides(cli.parse_args([*ARGS, "--jobs", "6"]), work / "m", work / "v.jsonl", task)
    budget = f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={cli.SHARED_GPU_TOKENS}"
    assert budget not in alone and not any("use_dynamic_bsz" in o for o in alone)
    assert {budget, "actor_rollout_ref.actor.use_dynamic_bsz=True"} <= set(shared)
    budget_keys = [o for o in shared if o not in alone]
    config, grpo = grpo_config(plan, work, **dict(o.split("=", 1) for o in budget_keys))
    assert config.actor_rollout_ref.actor.use_dynamic_bsz and all(row["equal"] for row in matched_pairs(config, grpo))


def test_a_side_cut_short_is_compared_over_the_steps_every_run_reached():
    """A budget stopped TRL after step 3 of 4: nonstop's last steps are taken up to step 3 too, or its step 4 would
    meet TRL's lower step 1."""
    ours = {0: _points([0.1, 0.5, 0.6, 0.7]), 1: _points([0.3, 0.5, 0.8, 0.7])}
    theirs = {0: _points([0.2, 0.3, 0.5]), 1: _points([0.2, 0.5, 0.5])}
    result = report.compare({"nonstop": ours, "trl": theirs}, {}, last=2)
    # Steps 2-3: nonstop seeds 0.55, 0.65 (mean 0.60); TRL 0.40, 0.50 (mean 0.45, std 0.0707).
    check = result["check_last_steps"]
    assert result["last_steps_end"] == 3
    assert check["nonstop"] == pytest.approx(0.60) and check["trl"] == pytest.approx(0.45) and check["passed"]
    assert "last 2 steps up to step 3, the last every run reached, trl: 0.450" in report.table(result, last=2)


def test_a_side_whose_seeds_share_no_step_is_reported_without_a_band():
    ours = {0: _points([0.1, 0.5]), 1: _points([0.3, 0.5])}
    theirs = {0: _points([0.2]), 1: [{**_points([0.1, 0.4])[1]}]}  # seed 1 logged step 2 only
    result = report.compare({"nonstop": ours, "trl": theirs}, {}, last=2)
    assert result["bands"]["trl"] == [] and result["last_steps_end"] == 2
    assert result["last_steps"]["trl"]["per_seed"] == [pytest.approx(0.2), pytest.approx(0.4)]
