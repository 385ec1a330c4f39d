"""This rank's part of a run from a `NonstopConfig`: device, policy model, engine, data, reward pool, reference, and
the `Trainer` (or, on a rollout rank of split placement, the `RolloutWorker`)."""

from __future__ import annotations

import copy

import torch

from nonstop.config import NonstopConfig
from nonstop.data import train_dataloader, val_dataloader
from nonstop.dist import current, init_process_group
from nonstop.dist.fsdp import shard_model
from nonstop.dist.placement import SplitPlacement, split_placement
from nonstop.dist.process_group import use_train_group
from nonstop.models.critic_model import CriticModel, load_critic_model
from nonstop.models.loading import default_model_path, load_model
from nonstop.models.lora import AdaptersOff, LoraConfig, apply_lora, has_lora, select_target_modules
from nonstop.models.tokenizer import load_tokenizer
from nonstop.rewards import RewardPool
from nonstop.rewards.reward_model import RewardModel
from nonstop.rollout import LLM, engine_args
from nonstop.trainer.checks import check_data_parallel, check_fsdp_sizes, check_no_validation, check_split
from nonstop.trainer.loop import Trainer
from nonstop.trainer.progress import build_lines
from nonstop.trainer.sources.rollout_rank import RolloutWorker


def torch_dtype(name: str) -> torch.dtype:
    """A config dtype name (`bfloat16` or `bf16`, ...) as a torch dtype."""
    return getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name))


def resolve_device(name: str) -> torch.device:
    """`trainer.device`: auto = cuda when a GPU is visible, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


def engine_dtype(config: NonstopConfig, device: torch.device) -> torch.dtype:
    """The engine's weight dtype: `rollout.dtype` on CUDA; on CPU the trainer's (fp32 masters), so a CPU engine
    copy holds the trainer's weights exactly."""
    if device.type == "cuda":
        return torch_dtype(config.actor_rollout_ref.rollout.dtype)
    return torch_dtype(config.actor_rollout_ref.actor.fsdp_config.model_dtype)


def build_engine(config: NonstopConfig, model: torch.nn.Module, tokenizer, device: torch.device) -> LLM:
    """On CUDA the engine holds a copy in `rollout.dtype` that `LLM.update_weights` refreshes after each step. On
    CPU, sync mode runs the trainer's fp32 model itself (no copy, no sync); the overlap modes need a copy there too
    (an fp32 one), since the engine generates while the optimizer changes the trainer's weights; so do several ranks
    (the trainer's parameters are FSDP shards, each rank's engine a whole model). With LoRA the engine always holds a
    plain copy (call this before `add_lora_adapters`) that receives merged weights."""
    engine_model = model
    lora = config.actor_rollout_ref.model.lora_rank > 0
    if device.type == "cuda" or config.trainer.mode != "sync" or current().distributed or lora:
        dtype = torch_dtype(config.actor_rollout_ref.rollout.dtype) if device.type == "cuda" else None
        engine_model = copy.deepcopy(model).to(dtype=dtype or next(model.parameters()).dtype)
        engine_model.requires_grad_(False)
    return engine_llm(config, engine_model, tokenizer)


def engine_llm(config: NonstopConfig, engine_model: torch.nn.Module, tokenizer) -> LLM:
    """The `LLM` around `engine_model` (used as is: its parameters are the engine's), sized per `rollout.*`."""
    return LLM(engine_model, tokenizer=tokenizer, **vars(engine_args(config)))


def add_lora_adapters(config: NonstopConfig, model: torch.nn.Module) -> None:
    """With `model.lora_rank > 0`: freeze `model` and give its target linears adapters (models/lora.py)."""
    model_cfg = config.actor_rollout_ref.model
    if model_cfg.lora_rank == 0:
        return
    targets = select_target_modules(model, model_cfg.target_modules, model_cfg.exclude_modules)
    lora = LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        lora_dropout=model_cfg.lora_dropout,
        target_modules=targets,
        base_model_name_or_path=model_cfg.path,
    )
    apply_lora(model, lora)


def reference_model(config: NonstopConfig, model: torch.nn.Module) -> torch.nn.Module | AdaptersOff | None:
    """The frozen reference of the KL loss: with LoRA the policy itself with its adapters off (no second model in
    memory), else a copy of the initial weights; None without a KL loss."""
    if not config.actor_rollout_ref.actor.use_kl_loss:
        return None
    if has_lora(model):
        return AdaptersOff(model)
    return copy.deepcopy(model).requires_grad_(False).eval()


def build_trainer(config: NonstopConfig, console: bool = True) -> Trainer | RolloutWorker:
    """This rank's part of the run: a trainer, or under `trainer.placement=split` on a rollout rank a
    `RolloutWorker` (same `fit` / `step` / `close`). `console`: rank 0 prints a line as each slow stage starts."""
    model_cfg, actor_cfg = config.actor_rollout_ref.model, config.actor_rollout_ref.actor
    device = resolve_device(config.trainer.device)
    # Joins torchrun's ranks (a no-op without torchrun, or when the caller already did): `nonstop train` and the
    # benchmarks alike then run data-parallel under torchrun.
    info = init_process_group(device.type, config.actor_rollout_ref.nccl_timeout)
    use_train_group(None)  # every rank trains unless split placement says otherwise (a previous build's choice goes)
    say = build_lines(console and info.rank == 0)
    placement = None
    if config.trainer.placement == "split":
        check_split(config, info.world_size)
        placement = split_placement(config.trainer.rollout_n_gpus, config.actor_rollout_ref.nccl_timeout)
        if placement.is_rollout:
            return build_rollout_worker(config, device, placement)
    check_data_parallel(config, current())  # the trainer ranks' group under split placement
    check_fsdp_sizes(config, current().world_size)
    if model_cfg.override_config:
        raise ValueError("actor_rollout_ref.model.override_config is not supported by the trainer yet")
    torch.manual_seed(0 if config.data.seed is None else config.data.seed)
    # null is the embedded default model: name its file (a missing package is load_model's error, with its hint)
    say(f"loading the policy from {model_cfg.path or default_model_path()} on {device}")
    model, tokenizer = load_policy(config, torch_dtype(actor_cfg.fsdp_config.model_dtype), device)
    model.gradient_checkpointing = model_cfg.enable_gradient_checkpointing
    critic_model = None
    if config.critic.enable:
        say(f"loading the critic from {config.critic.model.path or 'the policy'}")
        critic_model = build_critic_model(config, model, device)
    llm = None
    if placement is None:
        say("building the rollout engine (its weights and KV cache)")
        llm = build_engine(config, model, tokenizer, device)
    add_lora_adapters(config, model)
    ref_model = reference_model(config, model)
    compute_dtype = torch_dtype(actor_cfg.fsdp_config.dtype)
    if current().distributed:  # after the engine's copy: it holds the whole model
        say(f"sharding the models over {current().world_size} ranks")
        shard_model(model, actor_cfg.fsdp_config, device, compute_dtype)
        if ref_model is not None:
            shard_model(ref_model, config.actor_rollout_ref.ref.fsdp_config, device, compute_dtype)
        if critic_model is not None:
            critic_fsdp = config.critic.model.fsdp_config
            shard_model(critic_model, critic_fsdp, device, torch_dtype(critic_fsdp.dtype))
    reward_model = None
    if config.reward_model.enable:
        say(f"loading the reward model from {config.reward_model.model.path}")
        reward_model = RewardModel.from_config(config.reward_model, device)
    say("loading the data")
    val_loader = val_dataloader(config.data, tokenizer)
    train_loader = train_dataloader(config.data, tokenizer)
    extra = {}
    if placement is not None:
        check_no_validation(config, val_loader)
        extra = {"placement": placement, "wire_dtype": engine_dtype(config, device)}
    # Under split placement the rollout ranks score; the trainer's pool stays empty.
    if not placement and config.reward_model.num_workers != 0:
        say("starting the reward workers")
    pool = RewardPool(num_workers=0) if placement else reward_pool(config)
    try:
        return Trainer(
            config,
            model,
            tokenizer,
            llm,
            train_loader,
            pool,
            val_loader=val_loader,
            ref_model=ref_model,
            compute_dtype=compute_dtype if device.type == "cuda" else None,
            console=console,
            reward_model=reward_model,
            critic_model=critic_model,
            **extra,
        )
    except BaseException:
        pool.close()
        raise


def build_rollout_worker(config: NonstopConfig, device: torch.device, placement: SplitPlacement) -> RolloutWorker:
    """A rollout rank: the model loaded straight in the engine's dtype, the engine, the data and the reward pool."""
    torch.manual_seed(0 if config.data.seed is None else config.data.seed)
    dtype = engine_dtype(config, device)
    model, tokenizer = load_policy(config, dtype, device)
    model.requires_grad_(False)
    llm = engine_llm(config, model, tokenizer)
    pool = reward_pool(config)
    try:
        return RolloutWorker(config, llm, tokenizer, train_dataloader(config.data, tokenizer), pool, placement, dtype)
    except BaseException:
        pool.close()
        raise


def reward_pool(config: NonstopConfig) -> RewardPool:
    """The rule scorer's pool, sized (`reward_model.num_workers=null`) for the samples a step generates."""
    samples = config.data.gen_batch_size * config.actor_rollout_ref.rollout.n
    return RewardPool.from_config(config.reward_model, config.custom_reward_function, samples_per_step=samples)


def load_policy(config: NonstopConfig, dtype: torch.dtype, device: torch.device):
    """`actor_rollout_ref.model.path` in `dtype`, and its tokenizer (or `tokenizer_path`'s, with the custom chat
    template)."""
    model_cfg = config.actor_rollout_ref.model
    model, tokenizer = load_model(model_cfg.path, dtype=dtype, device=device)
    if model_cfg.tokenizer_path:
        tokenizer = load_tokenizer(model_cfg.tokenizer_path)
    if model_cfg.custom_chat_template:
        tokenizer.chat_template = model_cfg.custom_chat_template
    return model, tokenizer


def build_critic_model(config: NonstopConfig, policy: torch.nn.Module, device: torch.device) -> CriticModel:
    """From `critic.model.path`, or (null) a copy of the already loaded policy's trunk; in `critic.model.fsdp_config.
    model_dtype`."""
    critic_cfg = config.critic.model
    if critic_cfg.override_config:
        raise ValueError("critic.model.override_config is not supported by the trainer yet")
    dtype = torch_dtype(critic_cfg.fsdp_config.model_dtype)
    if critic_cfg.path is None:
        return CriticModel.from_policy(policy).to(dtype=dtype)
    return load_critic_model(critic_cfg.path, dtype=dtype, device=device)
