"""The settings both sides of `nonstop bench trl-parity` train with: nonstop's resolved config is the source, TRL
1.16's `GRPOConfig` is derived from it, and `matched_pairs` reads both back and compares them.

Loss normalisation (TRL 1.16 `GRPOTrainer._compute_loss`, nonstop `algos/aggregate.py`):
- `dapo` sums the token losses of the whole generation batch and divides by its number of completion tokens
  (`num_items_in_batch`, rescaled per accumulation window) = nonstop's `token-mean` over the mini-batch (verl's
  `global_batch_info`) when one generation batch is one optimizer step;
- `grpo` averages each completion's token mean, then over completions = `seq-mean-token-mean`;
- `bnpo` normalises by the tokens of one micro-batch, `dr_grpo` by `B x max_completion_length` where nonstop's
  `seq-mean-token-sum-norm` divides by a constant alone: neither has an exact nonstop counterpart, so they are not
  offered.
Advantages: `scale_rewards="group"` divides by the group's unbiased std (+1e-4; nonstop +1e-6) =
`norm_adv_by_std_in_grpo=True`; `"none"` = False (Dr. GRPO).

What TRL cannot reproduce is refused with the key to change (`check_matchable`): KL terms, several optimizer steps
per batch, the overlap modes (off-policy), dynamic sampling, weight decay (TRL exempts biases and norm weights from
it, nonstop decays every parameter), an entropy bonus, `ignore_eos`, warm-up given as a ratio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nonstop.config import NonstopConfig

LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
SCALE_REWARDS = {True: "group", False: "none"}
ADAM_EPSILON = 1e-8  # torch.optim.AdamW's default, which nonstop's optimizer uses


def check_matchable(config: NonstopConfig) -> None:
    """ValueError naming every setting of `config` that TRL's `GRPOTrainer` has no counterpart for."""
    actor = config.actor_rollout_ref.actor
    rollout, optim, algo = config.actor_rollout_ref.rollout, actor.optim, config.algorithm
    rules = [
        (algo.adv_estimator == "grpo", "algorithm.adv_estimator", algo.adv_estimator, "grpo"),
        (
            actor.loss_agg_mode in LOSS_TYPES,
            "actor_rollout_ref.actor.loss_agg_mode",
            actor.loss_agg_mode,
            " or ".join(LOSS_TYPES),
        ),
        (
            actor.policy_loss.loss_mode == "vanilla",
            "actor_rollout_ref.actor.policy_loss.loss_mode",
            actor.policy_loss.loss_mode,
            "vanilla",
        ),
        (not actor.use_kl_loss, "actor_rollout_ref.actor.use_kl_loss", actor.use_kl_loss, "False (TRL beta=0)"),
        (not algo.use_kl_in_reward, "algorithm.use_kl_in_reward", algo.use_kl_in_reward, "False"),
        (
            actor.ppo_mini_batch_size == config.data.train_batch_size,
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            actor.ppo_mini_batch_size,
            f"data.train_batch_size ({config.data.train_batch_size}): one optimizer step per batch",
        ),
        (actor.ppo_epochs == 1, "actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs, "1"),
        (actor.entropy_coeff == 0, "actor_rollout_ref.actor.entropy_coeff", actor.entropy_coeff, "0"),
        (
            optim.weight_decay == 0,
            "actor_rollout_ref.actor.optim.weight_decay",
            optim.weight_decay,
            "0 (TRL skips biases and norms)",
        ),
        (
            optim.lr_warmup_steps >= 0 or optim.lr_warmup_steps_ratio == 0,
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
            optim.lr_warmup_steps_ratio,
            "0 (give actor_rollout_ref.actor.optim.lr_warmup_steps)",
        ),
        (
            optim.lr_scheduler_type == "constant" or (optim.min_lr_ratio == 0 and optim.num_cycles == 0.5),
            "actor_rollout_ref.actor.optim.min_lr_ratio / num_cycles",
            (optim.min_lr_ratio, optim.num_cycles),
            "(0, 0.5): transformers' cosine schedule",
        ),
        (not rollout.ignore_eos, "actor_rollout_ref.rollout.ignore_eos", rollout.ignore_eos, "False"),
        (rollout.do_sample, "actor_rollout_ref.rollout.do_sample", rollout.do_sample, "True"),
        (config.trainer.mode == "sync", "trainer.mode", config.trainer.mode, "sync (TRL trains on-policy)"),
        (not algo.filter_groups.enable, "algorithm.filter_groups.enable", algo.filter_groups.enable, "False"),
        (
            algo.rollout_correction.rollout_is is None,
            "algorithm.rollout_correction.rollout_is",
            algo.rollout_correction.rollout_is,
            "null",
        ),
        (not config.reward_model.enable, "reward_model.enable", config.reward_model.enable, "False"),
        (not config.data.shuffle, "data.shuffle", config.data.shuffle, "False (the bench writes the order)"),
        (
            config.actor_rollout_ref.model.lora_rank == 0,
            "actor_rollout_ref.model.lora_rank",
            config.actor_rollout_ref.model.lora_rank,
            "0",
        ),
    ]
    bad = [f"{key}={value!r} (needs {want})" for ok, key, value, want in rules if not ok]
    if bad:
        raise ValueError("settings TRL's GRPOTrainer cannot reproduce: " + "; ".join(bad))


def grpo_kwargs(config: NonstopConfig, output_dir: str, cuda: bool, micro_batch: int | None = None) -> dict[str, Any]:
    """`trl.GRPOConfig` arguments for the run `config` describes. One generation batch (prompts x n) is one
    optimizer step: `micro_batch` samples per forward (default all of them) and gradient accumulation over the rest
    (`steps_per_generation` follows it). On CUDA both sides keep fp32 master weights and compute in bf16; on CPU
    both run fp32."""
    check_matchable(config)
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    optim = actor.optim
    batch = config.data.train_batch_size * rollout.n
    micro = micro_batch or batch
    if batch % micro:
        raise ValueError(f"TRL micro-batch {micro} must divide prompts x n = {batch}")
    warmup = max(optim.lr_warmup_steps, 0)
    scheduler = {"constant": "constant_with_warmup" if warmup else "constant", "cosine": "cosine"}
    fsdp = actor.fsdp_config
    if cuda and (fsdp.model_dtype not in ("fp32", "float32") or fsdp.dtype not in ("bf16", "bfloat16")):
        raise ValueError(
            f"actor fsdp_config model_dtype={fsdp.model_dtype}, dtype={fsdp.dtype}: on CUDA the TRL side runs fp32 "
            "master weights under bf16 autocast, so nonstop must too (model_dtype=fp32, dtype=bfloat16)"
        )
    return {
        "output_dir": output_dir,
        "max_steps": config.trainer.total_training_steps,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": batch // micro,
        "num_iterations": 1,
        "num_generations": rollout.n,
        "max_completion_length": config.data.max_response_length,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": 0 if rollout.top_k <= 0 else rollout.top_k,
        "learning_rate": optim.lr,
        "lr_scheduler_type": scheduler[optim.lr_scheduler_type],
        "warmup_steps": warmup,
        "weight_decay": optim.weight_decay,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "adam_epsilon": ADAM_EPSILON,
        "optim": "adamw_torch_fused" if cuda else "adamw_torch",  # nonstop's AdamW: fused on CUDA, foreach on CPU
        "max_grad_norm": actor.grad_clip,
        "beta": 0.0,
        "loss_type": LOSS_TYPES[actor.loss_agg_mode],
        "scale_rewards": SCALE_REWARDS[config.algorithm.norm_adv_by_std_in_grpo],
        "epsilon": actor.clip_ratio_low,
        "epsilon_high": actor.clip_ratio_high,
        "importance_sampling_level": "token",
        "mask_truncated_completions": False,
        "top_entropy_quantile": 1.0,
        "entropy_coef": 0.0,
        "shuffle_dataset": False,
        "seed": 0 if config.data.seed is None else config.data.seed,
        "bf16": cuda,
        "use_cpu": not cuda,
        "model_init_kwargs": {"dtype": "float32"},
        "gradient_checkpointing": config.actor_rollout_ref.model.enable_gradient_checkpointing,
        "disable_dropout": True,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


@dataclass(frozen=True)
class Pair:
    """One setting on both sides: where nonstop reads it, where TRL does, and each read as a comparable value
    (`shown`: nonstop's value as the config spells it, where that differs)."""

    setting: str
    nonstop_key: str
    trl_field: str
    nonstop: Callable[[NonstopConfig], Any]
    trl: Callable[[Any], Any]
    how: str = ""
    shown: Callable[[NonstopConfig], Any] | None = None


def _top_k(value: int | None) -> int | None:
    return None if value is None or value <= 0 else value


def _schedule(config: NonstopConfig) -> tuple[str, int]:
    optim = config.actor_rollout_ref.actor.optim
    return optim.lr_scheduler_type, max(optim.lr_warmup_steps, 0)


PAIRS = (
    Pair("prompts per step", "data.train_batch_size", "generation_batch_size / num_generations",
         lambda c: c.data.train_batch_size, lambda g: g.generation_batch_size // g.num_generations),
    Pair("samples per prompt", "actor_rollout_ref.rollout.n", "num_generations",
         lambda c: c.actor_rollout_ref.rollout.n, lambda g: g.num_generations),
    Pair("optimizer steps per batch", "data.train_batch_size / actor.ppo_mini_batch_size x ppo_epochs",
         "generation_batch_size / (per_device_train_batch_size x gradient_accumulation_steps) x num_iterations",
         lambda c: c.data.train_batch_size // c.actor_rollout_ref.actor.ppo_mini_batch_size
         * c.actor_rollout_ref.actor.ppo_epochs,
         lambda g: g.generation_batch_size // (g.per_device_train_batch_size * g.gradient_accumulation_steps)
         * g.num_iterations,
         "one generation batch = one optimizer step (steps_per_generation = gradient_accumulation_steps)"),
    Pair("temperature", "actor_rollout_ref.rollout.temperature", "temperature",
         lambda c: c.actor_rollout_ref.rollout.temperature, lambda g: g.temperature),
    Pair("top-p", "actor_rollout_ref.rollout.top_p", "top_p",
         lambda c: c.actor_rollout_ref.rollout.top_p, lambda g: g.top_p),
    Pair("top-k (off = None)", "actor_rollout_ref.rollout.top_k", "top_k",
         lambda c: _top_k(c.actor_rollout_ref.rollout.top_k), lambda g: _top_k(g.top_k), "nonstop -1 = TRL 0 = off",
         shown=lambda c: c.actor_rollout_ref.rollout.top_k),
    Pair("response limit", "data.max_response_length", "max_completion_length",
         lambda c: c.data.max_response_length, lambda g: g.max_completion_length),
    Pair("learning rate", "actor.optim.lr", "learning_rate",
         lambda c: c.actor_rollout_ref.actor.optim.lr, lambda g: g.learning_rate),
    Pair("schedule (type, warm-up steps)", "actor.optim.lr_scheduler_type, lr_warmup_steps",
         "lr_scheduler_type, warmup_steps", _schedule,
         lambda g: (str(g.lr_scheduler_type.value).removesuffix("_with_warmup"), int(g.warmup_steps)),
         "linear warm-up from 0, then constant or cosine to 0: the same LambdaLR rule on both"),
    Pair("clip range (low, high)", "actor.clip_ratio_low, clip_ratio_high", "epsilon, epsilon_high",
         lambda c: (c.actor_rollout_ref.actor.clip_ratio_low, c.actor_rollout_ref.actor.clip_ratio_high),
         lambda g: (g.epsilon, g.epsilon_high)),
    Pair("KL coefficient", "actor.use_kl_loss, algorithm.use_kl_in_reward", "beta",
         lambda c: 0.0 if not (c.actor_rollout_ref.actor.use_kl_loss or c.algorithm.use_kl_in_reward) else None,
         lambda g: g.beta, "no KL term: no reference model on either side",
         shown=lambda c: (c.actor_rollout_ref.actor.use_kl_loss, c.algorithm.use_kl_in_reward)),
    Pair("loss normalisation", "actor.loss_agg_mode", "loss_type",
         lambda c: LOSS_TYPES.get(c.actor_rollout_ref.actor.loss_agg_mode), lambda g: g.loss_type,
         "token-mean = dapo (tokens of the whole batch); seq-mean-token-mean = grpo",
         shown=lambda c: c.actor_rollout_ref.actor.loss_agg_mode),
    Pair("advantage scaling", "algorithm.norm_adv_by_std_in_grpo", "scale_rewards",
         lambda c: SCALE_REWARDS[c.algorithm.norm_adv_by_std_in_grpo], lambda g: g.scale_rewards,
         "group std: nonstop +1e-6, TRL +1e-4", shown=lambda c: c.algorithm.norm_adv_by_std_in_grpo),
    Pair("gradient clip", "actor.grad_clip", "max_grad_norm",
         lambda c: c.actor_rollout_ref.actor.grad_clip, lambda g: g.max_grad_norm),
    Pair("AdamW betas", "actor.optim.betas", "adam_beta1, adam_beta2",
         lambda c: tuple(c.actor_rollout_ref.actor.optim.betas), lambda g: (g.adam_beta1, g.adam_beta2)),
    Pair("AdamW epsilon", "(torch default)", "adam_epsilon", lambda c: ADAM_EPSILON, lambda g: g.adam_epsilon),
    Pair("weight decay", "actor.optim.weight_decay", "weight_decay",
         lambda c: c.actor_rollout_ref.actor.optim.weight_decay, lambda g: g.weight_decay),
    Pair("entropy bonus", "actor.entropy_coeff", "entropy_coef",
         lambda c: c.actor_rollout_ref.actor.entropy_coeff, lambda g: g.entropy_coef),
    Pair("prompt order shuffled", "data.shuffle", "shuffle_dataset",
         lambda c: c.data.shuffle, lambda g: g.shuffle_dataset, "both read the seed's order from the same file"),
    Pair("steps", "trainer.total_training_steps", "max_steps",
         lambda c: c.trainer.total_training_steps, lambda g: g.max_steps),
    Pair("seed", "data.seed", "seed", lambda c: c.data.seed, lambda g: g.seed),
    Pair("gradient checkpointing", "actor_rollout_ref.model.enable_gradient_checkpointing", "gradient_checkpointing",
         lambda c: c.actor_rollout_ref.model.enable_gradient_checkpointing, lambda g: g.gradient_checkpointing),
)  # fmt: skip


def matched_pairs(config: NonstopConfig, grpo_config: Any) -> list[dict[str, Any]]:
    """Every `PAIRS` setting read from nonstop's resolved config and from a constructed `trl.GRPOConfig` (after its
    own `__post_init__`), with whether they agree."""
    rows = []
    for pair in PAIRS:
        ours, theirs = pair.nonstop(config), pair.trl(grpo_config)
        shown = pair.shown(config) if pair.shown else ours
        rows.append(
            {
                "setting": pair.setting,
                "nonstop": f"{pair.nonstop_key} = {shown!r}",
                "trl": f"{pair.trl_field} = {theirs!r}",
                "equal": ours == theirs,
                "how": pair.how,
            }
        )
    return rows


def pairs_table(rows: list[dict[str, Any]]) -> str:
    width = max(len(r["setting"]) for r in rows)
    lines = [f"{'setting':{width}}  ok  nonstop | TRL"]
    lines += [f"{r['setting']:{width}}  {'==' if r['equal'] else '!='}  {r['nonstop']} | {r['trl']}" for r in rows]
    return "\n".join(lines)
