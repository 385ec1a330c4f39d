"""One model definition for trainer and rollout engine, with Hugging Face and GGUF loading."""

from nonstop.models.attention import PackedAttention, packed_positions
from nonstop.models.config import ModelConfig
from nonstop.models.transformer import CausalLM

__all__ = ["CausalLM", "ModelConfig", "PackedAttention", "packed_positions"]
