"""The one decoder-only transformer nonstop trains and serves: Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3.

Parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`), so checkpoints load and save without
a mapping table. Inputs are packed: a flat run of tokens with explicit positions; the attention backend passed in
decides which tokens see which (see attention.py). The forward returns final-norm hidden states, not logits, so
callers can project to the vocabulary in chunks and never hold `[T, V]` fp32 logits whole.

Legend: T packed tokens, D hidden size, I intermediate size, H query heads, K key/value heads, E head dim,
V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from nonstop.kernels.rms_norm import rms_norm
from nonstop.kernels.rotary import apply_rotary_qk
from nonstop.kernels.silu_mul import silu_and_mul
from nonstop.models.attention import AttentionBackend
from nonstop.models.config import ModelConfig
from nonstop.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x_TD: Tensor, cos_TE: Tensor, sin_TE: Tensor, attention: AttentionBackend) -> Tensor:
        T = x_TD.shape[0]
        q_THE = self.q_proj(x_TD).view(T, self.num_heads, self.head_dim)
        k_TKE = self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        v_TKE = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q_THE, k_TKE = self.q_norm(q_THE), self.k_norm(k_TKE)
        q_THE, k_TKE = apply_rotary_qk(q_THE, k_TKE, cos_TE, sin_TE)
        o_THE = attention(self.layer_idx, q_THE, k_TKE, v_TKE)
        return self.o_proj(o_THE.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x_TD: Tensor) -> Tensor:
        return self.down_proj(silu_and_mul(self.gate_proj(x_TD), self.up_proj(x_TD)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h_TD: Tensor, cos_TE: Tensor, sin_TE: Tensor, attention: AttentionBackend) -> Tensor:
        h_TD = h_TD + self.self_attn(self.input_layernorm(h_TD), cos_TE, sin_TE, attention)
        return h_TD + self.mlp(self.post_attention_layernorm(h_TD))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False

    def forward(self, input_ids_T: Tensor, positions_T: Tensor, attention: AttentionBackend) -> Tensor:
        """Final-norm hidden states `[T, D]` for packed tokens."""
        h_TD = self.model.embed_tokens(input_ids_T)
        cos_TE, sin_TE = self.model.rotary_emb(positions_T, h_TD.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h_TD = checkpoint(layer, h_TD, cos_TE, sin_TE, attention, use_reentrant=False)
            else:
                h_TD = layer(h_TD, cos_TE, sin_TE, attention)
        return self.model.norm(h_TD)

    def compute_logits(self, h_TD: Tensor) -> Tensor:
        return self.lm_head(h_TD)

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> CausalLM:
        """Random weights in the model's real shape: what benchmarks run when real weights do not matter."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=generator)
        return self
