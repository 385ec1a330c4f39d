"""examples/: every YAML config loads with the current schema, and the example reward function scores as documented;
the verl migration page lists every unsupported-key rule.

These guard the examples against config drift: a renamed or removed key, or a new cross-key check, fails here
instead of in a user's first run.
"""

from pathlib import Path

import pytest

from nonstop.config import EMBEDDED_RUN_OVERRIDES, config_to_dict, load_config
from nonstop.config.unsupported import RULES
from nonstop.rewards import load_custom_reward_fn

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
YAMLS = sorted(EXAMPLES.glob("*.yaml"))


def test_examples_exist():
    names = {p.name for p in YAMLS}
    assert {
        "arith_smollm2.yaml",
        "dapo_smollm2.yaml",
        "gsm8k_smollm2.yaml",
        "gsm8k_smollm2_cpu.yaml",
        "qwen2_5_0_5b_throughput.yaml",
    } <= names


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_example_config_loads(path):
    load_config(str(path))


def test_arith_example_is_the_embedded_default():
    written_out = load_config(str(EXAMPLES / "arith_smollm2.yaml"))
    embedded = load_config(None, EMBEDDED_RUN_OVERRIDES)
    assert config_to_dict(written_out) == config_to_dict(embedded)


def test_gsm8k_example_reads_what_nonstop_data_gsm8k_writes():
    cfg = load_config(str(EXAMPLES / "gsm8k_smollm2.yaml"))
    assert cfg.data.train_files == "data/gsm8k/train.parquet"
    assert cfg.data.val_files == "data/gsm8k/test.parquet"
    assert cfg.trainer.test_freq > 0
    # The longest GSM8K prompt is 268 tokens under SmolLM2's chat template.
    assert cfg.data.max_prompt_length >= 268


def test_cpu_gsm8k_example_is_sized_for_a_cpu():
    """Not verl's defaults (PPO with a critic, 1,024 prompts a step, 1,319 validation prompts first)."""
    cfg = load_config(str(EXAMPLES / "gsm8k_smollm2_cpu.yaml"))
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.critic.enable
    assert cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n <= 16
    assert 0 < cfg.data.val_max_samples <= 8 and not cfg.trainer.val_before_train
    assert cfg.trainer.total_training_steps <= 5 and cfg.data.max_response_length <= 96
    assert cfg.data.train_files == "data/gsm8k/train.parquet"


def test_throughput_example_is_the_benchmark_workload():
    cfg = load_config(str(EXAMPLES / "qwen2_5_0_5b_throughput.yaml"))
    rollout = cfg.actor_rollout_ref.rollout
    assert (cfg.data.train_batch_size, rollout.n, cfg.data.max_response_length) == (8, 8, 256)
    assert rollout.ignore_eos


def test_dapo_example_has_the_recipes_settings():
    cfg = load_config(str(EXAMPLES / "dapo_smollm2.yaml"))
    actor, algorithm = cfg.actor_rollout_ref.actor, cfg.algorithm
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert not actor.use_kl_loss and not algorithm.use_kl_in_reward
    assert algorithm.filter_groups.enable and algorithm.filter_groups.metric == "acc"
    assert algorithm.filter_groups.max_num_gen_batches > 0
    assert cfg.data.gen_batch_size == 3 * cfg.data.train_batch_size
    buffer = cfg.reward_model.overlong_buffer
    assert buffer.enable and 0 < buffer.len < cfg.data.max_response_length and buffer.penalty_factor == 1.0
    assert cfg.data.max_prompt_length >= 268


@pytest.fixture(scope="module")
def example_reward_fn():
    return load_custom_reward_fn(str(EXAMPLES / "reward_fn.py"), "compute_score")


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("She sells 9 eggs at $2 each.\n#### $18.00", "18", 1.0),  # the marked answer, "$" and ".00" ignored
        ("#### 1,234", "1234", 1.0),  # thousands separators removed
        ("7 + 5 = 12", "12", 1.0),  # no marker: the last number
        ("#### 17\nthough 18 would also do", "18", 0.0),  # the marker wins over a later number
        ("no number here", "3", 0.0),
        ("x" * 401 + " 3", "3", 0.8),  # correct but longer than max_chars=400: 1.0 - length_penalty 0.2
    ],
)
def test_example_reward_function(example_reward_fn, response, ground_truth, expected):
    score = example_reward_fn(
        data_source="openai/gsm8k", solution_str=response, ground_truth=ground_truth, extra_info=None
    )
    assert score == pytest.approx(expected)


def test_migration_page_lists_every_unsupported_rule():
    """docs/migrating-from-verl.md's table is generated from unsupported.py: a new rule needs a row there."""
    page = (EXAMPLES.parent / "docs" / "migrating-from-verl.md").read_text()
    missing = [rule.pattern for rule in RULES if f"| `{rule.pattern}` |" not in page]
    assert not missing, f"add rows for {missing} to the unsupported-keys table of docs/migrating-from-verl.md"


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("3 + 4 = 7 apples.\n#### 7", "7", {"score": 1.0, "acc": 1.0}),
        ("#### 1,234", "1234", {"score": 1.0, "acc": 1.0}),  # verl's rule drops commas in the marked answer
        ("3 + 4 = 8 apples.\n#### 8", "7", {"score": 0.1, "acc": 0.0}),  # well formed, wrong: the format bonus
        ("The answer is 7.", "7", {"score": 0.0, "acc": 0.0}),  # right number, no "####": the strict rule says 0
    ],
)
def test_gsm8k_format_reward(response, ground_truth, expected):
    fn = load_custom_reward_fn(str(EXAMPLES / "gsm8k_reward.py"), "compute_score", {"format_score": 0.1})
    assert fn(data_source="openai/gsm8k", solution_str=response, ground_truth=ground_truth) == expected


def test_gsm8k_example_uses_the_format_reward():
    cfg = load_config(str(EXAMPLES / "gsm8k_smollm2.yaml"))
    assert cfg.custom_reward_function.path == "examples/gsm8k_reward.py"
    assert cfg.custom_reward_function.reward_kwargs == {"format_score": 0.1}
