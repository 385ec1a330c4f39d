"""The engine's settings in one place: `EngineArgs` (vLLM's names), and `engine_args` turning a run's config into
them. Every default is the rollout config's (`actor_rollout_ref.rollout.*`), so `LLM(...)`, `nonstop generate` and
the trainer's engine start from the same values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from nonstop.config.errors import ConfigError
from nonstop.config.rollout import CASCADE_CHOICES, RolloutConfig, SpeculativeConfig

_DEFAULT = RolloutConfig()


@dataclass
class EngineArgs:
    block_size: int = 16
    max_num_seqs: int = _DEFAULT.max_num_seqs
    max_num_batched_tokens: int = _DEFAULT.max_num_batched_tokens
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # an explicit KV cache size; None: sized from memory
    gpu_memory_utilization: float = _DEFAULT.gpu_memory_utilization
    enforce_eager: bool = _DEFAULT.enforce_eager
    # Decode batch sizes captured as CUDA graphs; None: 1, 2, 4, 8, then multiples of 16 up to max_num_seqs.
    cudagraph_capture_sizes: list[int] | None = None
    # False: a prompt is prefilled in one step, never split across steps (it must fit max_num_batched_tokens).
    enable_chunked_prefill: bool = _DEFAULT.enable_chunked_prefill
    enable_prefix_caching: bool = _DEFAULT.enable_prefix_caching
    # Overlap each step's host work with the next step on the device (llm_engine.py). False: read every step's
    # tokens before scheduling the next.
    async_scheduling: bool = True
    # Decode steps chained on the device per launch when only decoding (scheduler.py); None: 8 on CUDA, 1 elsewhere.
    num_scheduler_steps: int | None = _DEFAULT.num_scheduler_steps
    cascade_attention: bool | str = _DEFAULT.cascade_attention  # True, False or "auto" (cascade.py)
    # Speculative decoding (rollout/spec/): the rollout config's `speculative` section, or a dict of its keys
    # (vLLM's `speculative_config`).
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    seed: int = 0

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks", "num_scheduler_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.cascade_attention not in CASCADE_CHOICES:
            raise ValueError(f"cascade_attention must be one of {CASCADE_CHOICES}, got {self.cascade_attention!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        spec = self.speculative_config
        if isinstance(spec, dict):
            known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
            unknown = sorted(set(spec) - known)
            if unknown:
                raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
            try:
                self.speculative_config = SpeculativeConfig(**spec)
            except ConfigError as e:
                raise ValueError(str(e.under("speculative_config"))) from None
        elif not isinstance(spec, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a dict or a SpeculativeConfig, got {spec!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not sizes or any(s < 1 for s in sizes):
                raise ValueError(f"cudagraph_capture_sizes must be a non-empty list of sizes >= 1, got {sizes}")
            self.cudagraph_capture_sizes = sorted({min(s, self.max_num_seqs) for s in sizes})

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineArgs:
        """`EngineArgs(**kwargs)`, naming an unknown keyword and the known ones instead of a bare TypeError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; the engine takes {sorted(known)}")
        return cls(**kwargs)


def engine_args(config: Any) -> EngineArgs:
    """A run's `actor_rollout_ref.rollout.*` (plus the data lengths and seed) as the engine's arguments."""
    rollout, data = config.actor_rollout_ref.rollout, config.data
    return EngineArgs(
        max_num_seqs=rollout.max_num_seqs,
        max_num_batched_tokens=rollout.max_num_batched_tokens,
        max_model_len=rollout.max_model_len or data.max_prompt_length + data.max_response_length,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        enforce_eager=rollout.enforce_eager,
        cudagraph_capture_sizes=rollout.cudagraph_capture_sizes,
        enable_chunked_prefill=rollout.enable_chunked_prefill,
        enable_prefix_caching=rollout.enable_prefix_caching,
        num_scheduler_steps=rollout.num_scheduler_steps,
        cascade_attention=rollout.cascade_attention,
        speculative_config=rollout.speculative,
        seed=0 if data.seed is None else data.seed,
    )
