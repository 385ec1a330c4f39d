"""Helpers for the trainer tests. A trivially learnable task: reward = fraction of response tokens equal to
token 7, on a tiny random `CausalLM` with a 32-token vocabulary."""

from __future__ import annotations

import copy
import json
import time

import torch

from nonstop.config import load_config
from nonstop.data import PromptRow, TokenizedPrompt
from nonstop.dist.fsdp import shard_model
from nonstop.models import CausalLM, ModelConfig
from nonstop.models.critic_model import CriticModel
from nonstop.rewards import RewardPool
from nonstop.rewards.reward_model import RewardModel
from nonstop.rollout import LLM
from nonstop.trainer import Trainer
from nonstop.trainer.build import add_lora_adapters, build_engine, reference_model

TARGET_TOKEN = 7
VOCAB = 32
TIMING_PREFIXES = ("timing_s/", "perf/")
# Fractions of generation wall time: they vary from run to run like the timings themselves.
WALL_TIME_WEIGHTED = {
    "rollout/tail_frac",
    "rollout/tail_batch_fill",
    "rollout/kv_blocked_frac",
    "rollout/small_batch_frac",
}


def seven_fraction(data_source, solution_str, ground_truth, extra_info=None) -> float:
    tokens = solution_str.split()
    return sum(t == str(TARGET_TOKEN) for t in tokens) / max(1, len(tokens))


def slow_seven_fraction(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """`seven_fraction`, taking long enough that collecting a step's rewards waits for them."""
    time.sleep(0.05)
    return seven_fraction(data_source, solution_str, ground_truth, extra_info)


class IdTokenizer:
    """Token ids as decimal words; enough for `decode(ids, skip_special_tokens=True)`."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in ids)


class FixedPrompts:
    """`batch_size` random prompts per batch, fresh uids each batch (a `PromptDataLoader` stand-in)."""

    def __init__(self, batch_size: int, seed: int = 0, num_batches: int = 1000):
        self.batch_size, self.generator, self.count = batch_size, torch.Generator().manual_seed(seed), 0
        self.num_batches = num_batches

    def __len__(self) -> int:
        return self.num_batches

    def state_dict(self) -> dict:
        return {"count": self.count, "generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))

    def next_batch(self) -> list[TokenizedPrompt]:
        batch = []
        for _ in range(self.batch_size):
            length = int(torch.randint(2, 6, (1,), generator=self.generator))
            ids = torch.randint(8, VOCAB, (length,), generator=self.generator).tolist()
            row = PromptRow(data_source="test/seven", prompt=[], ground_truth="", uid=f"p{self.count}")
            batch.append(TokenizedPrompt(row=row, prompt_token_ids=ids))
            self.count += 1
        return batch


def comparable(path) -> list[dict]:
    """metrics.jsonl rows without wall-clock values (`timing_s/*`, `perf/*`, `*_s` seconds, time-weighted)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    clock = lambda k: k.startswith(TIMING_PREFIXES) or k.endswith("_s") or k in WALL_TIME_WEIGHTED  # noqa: E731
    return [{k: v for k, v in row.items() if not clock(k)} for row in rows]


def tiny_model(seed: int = 0) -> CausalLM:
    config = ModelConfig(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    return CausalLM(config).init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def tiny_run_config(run_dir, overrides: tuple[str, ...] = ()):
    """The trainer tests' config: 4 prompts x 8 samples, 8-token prompts and responses, 8 steps."""
    return load_config(
        None,
        (
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=4",
            "data.max_prompt_length=8",
            "data.max_response_length=8",
            "data.seed=3",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=3e-2",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "trainer.total_training_steps=8",
            "trainer.val_before_train=False",
            f"trainer.default_local_dir={run_dir}",
            *overrides,
        ),
    )


def make_trainer(
    run_dir,
    overrides: tuple[str, ...] = (),
    seed: int = 0,
    validate: bool = False,
    engine_copy: bool = False,
    device: str = "cpu",
    reward_fn=seven_fraction,
    shard: bool = False,
    reward_workers: int = 0,
) -> Trainer:
    """`engine_copy`: the engine gets its own copy of the weights (as on CUDA, and always in the overlap modes
    `trainer.mode=one_step_off|async`) instead of sharing the trainer's.
    `device="cuda"`: the production CUDA path (`build_engine`: a bf16 engine copy; bf16 autocast updates).
    `reward_fn`: the scorer, `(data_source, solution_str, ground_truth, extra_info) -> float`.
    `shard`: FSDP2 over the initialised process group, after the engine took its copy (as `build_trainer` does), for
    the critic too when the config has one.
    `reward_workers`: the reward pool's worker processes (0: scored inline as each sample finishes)."""
    config = tiny_run_config(run_dir, overrides)
    torch.manual_seed(seed)
    model = tiny_model(seed).to(device)
    tokenizer = IdTokenizer()
    lora = config.actor_rollout_ref.model.lora_rank > 0
    if device == "cuda":
        llm = build_engine(config, model, tokenizer, torch.device(device))
    else:
        llm = LLM(
            copy.deepcopy(model) if engine_copy or lora or config.trainer.mode != "sync" else model,
            tokenizer=tokenizer,
            device="cpu",
            max_model_len=16,
            num_kv_blocks=64,
            max_num_seqs=config.actor_rollout_ref.rollout.max_num_seqs,
            seed=seed,
        )
    add_lora_adapters(config, model)  # after the engine copy, as build_trainer does
    critic_model = None
    if shard:
        if config.critic.enable:  # copied from the policy before either is sharded, as build_trainer does
            critic_model = CriticModel.from_policy(model)
            shard_model(critic_model, config.critic.model.fsdp_config, torch.device(device), torch.float32)
        shard_model(model, config.actor_rollout_ref.actor.fsdp_config, torch.device(device), torch.float32)
    return Trainer(
        config,
        model,
        tokenizer,
        llm,
        FixedPrompts(config.data.gen_batch_size, seed),
        RewardPool(reward_fn, num_workers=reward_workers),
        val_loader=FixedPrompts(8, seed + 100, num_batches=1) if validate else None,
        ref_model=reference_model(config, model),
        compute_dtype=torch.bfloat16 if device == "cuda" else None,
        console=False,
        reward_model=RewardModel.from_config(config.reward_model, model_device(model))
        if config.reward_model.enable
        else None,
        critic_model=critic_model,
    )
