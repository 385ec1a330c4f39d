"""One model definition for trainer and rollout engine, with Hugging Face and GGUF loading."""

from nonstop.models.attention import PackedAttention, packed_positions
from nonstop.models.config import ModelConfig
from nonstop.models.gguf_loader import load_gguf_model
from nonstop.models.hf_loader import load_hf_model
from nonstop.models.loading import default_model_path, load_model
from nonstop.models.save import save_hf
from nonstop.models.tokenizer import encode_chat, load_tokenizer
from nonstop.models.transformer import CausalLM

__all__ = [
    "CausalLM",
    "ModelConfig",
    "PackedAttention",
    "default_model_path",
    "encode_chat",
    "load_gguf_model",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "packed_positions",
    "save_hf",
]
