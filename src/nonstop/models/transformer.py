"""The one decoder-only transformer nonstop trains and serves: Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3.

Parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`), so checkpoints load and save without
a mapping table. Inputs are packed: a flat run of tokens with explicit positions; the attention backend passed in
decides which tokens see which (see attention.py). The forward returns final-norm hidden states, not logits, so
callers can project to the vocabulary in chunks and never hold `[T, V]` fp32 logits whole.

Fused projections (`CausalLM.fuse_projections`, for the rollout engine's inference-only model): q/k/v become one
GEMM and gate/up another, over ONE weight buffer per group whose rows the separate parameters are views of. Names,
shapes and Parameter objects stay what trainers and loaders know; a copy into `q_proj.weight` lands in the fused
buffer, so in-place weight updates keep working at unchanged addresses (CUDA graphs stay valid). Under autograd the
separate projections run as always, so training is untouched.

The residual stream follows vLLM: a layer takes the previous layer's MLP output and the residual stream it has not
joined yet, and each norm adds the two before normalising (`RMSNorm.add_and_norm`), one Triton launch in CUDA
inference where an add and a norm would be two; the final norm makes the last add.

Legend: T packed tokens, D hidden size, I intermediate size, H query heads, K key/value heads, E head dim,
V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from nonstop.kernels.dispatch import use_fused_projections
from nonstop.kernels.rms_norm import fused_add_rms_norm, rms_norm
from nonstop.kernels.rotary import apply_rotary_qk
from nonstop.kernels.silu_mul import silu_and_mul
from nonstop.models.attention import AttentionBackend
from nonstop.models.config import ModelConfig
from nonstop.models.rope import RotaryEmbedding


class FusedLinear:
    """One [sum of out features, in features] weight (and bias) whose row blocks the given linears' parameters
    become views of. Not a module: nothing new appears in `named_parameters` or the state dict."""

    def __init__(self, linears: list[nn.Linear]):
        with torch.no_grad():
            self.weight = torch.cat([linear.weight for linear in linears])
            has_bias = linears[0].bias is not None
            self.bias = torch.cat([linear.bias for linear in linears]) if has_bias else None
        offset = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            # `.data`, not a new Parameter: optimizers and callers holding the Parameter objects keep them.
            linear.weight.data = self.weight[offset : offset + rows]
            if has_bias:
                linear.bias.data = self.bias[offset : offset + rows]
            offset += rows
        self.linears = linears
        self.addresses = self._addresses()

    def _addresses(self) -> list[int]:
        return [p.data_ptr() for linear in self.linears for p in (linear.weight, linear.bias) if p is not None]

    @property
    def intact(self) -> bool:
        """Whether the linears' parameters are still views of this buffer: a `.to()`, `load_state_dict(assign=True)`
        or a new Parameter gives them other tensors (at other addresses, since this buffer keeps the old memory
        alive), and the separate projections then run, which is always correct."""
        return self._addresses() == self.addresses

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x_TD: Tensor, residual_TD: Tensor | None) -> tuple[Tensor, Tensor]:
        """(norm(residual + x), residual + x); with no residual yet (the first layer), x starts the stream."""
        if residual_TD is None:
            return self(x_TD), x_TD
        return fused_add_rms_norm(x_TD, residual_TD, self.weight, self.eps)


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
        self.qk_norm = config.qk_norm  # read per layer call: `hasattr(self, "q_norm")` raises and catches inside torch
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qkv_proj: FusedLinear | None = None

    def forward(self, x_TD: Tensor, cos_TE: Tensor, sin_TE: Tensor, attention: AttentionBackend) -> Tensor:
        T, H, K, E = x_TD.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and use_fused_projections() and self.qkv_proj.intact:
            # Column slices of one [T, (H + 2K) E] output: strided views with contiguous heads, which the norm,
            # rotary, KV-cache write and FlashAttention all accept.
            qkv_TX = self.qkv_proj(x_TD)
            q_THE = qkv_TX[:, : H * E].view(T, H, E)
            k_TKE = qkv_TX[:, H * E : (H + K) * E].view(T, K, E)
            v_TKE = qkv_TX[:, (H + K) * E :].view(T, K, E)
        else:
            q_THE = self.q_proj(x_TD).view(T, H, E)
            k_TKE = self.k_proj(x_TD).view(T, K, E)
            v_TKE = self.v_proj(x_TD).view(T, K, E)
        if self.qk_norm:
            q_THE, k_TKE = self.q_norm(q_THE), self.k_norm(k_TKE)
        rotary_attention = getattr(attention, "rotary_attention", None)
        if rotary_attention is not None:  # the backend rotates (fused with its KV-cache write)
            o_THE = rotary_attention(self.layer_idx, q_THE, k_TKE, v_TKE, cos_TE, sin_TE)
        else:
            q_THE, k_TKE = apply_rotary_qk(q_THE, k_TKE, cos_TE, sin_TE)
            o_THE = attention(self.layer_idx, q_THE, k_TKE, v_TKE)
        return self.o_proj(o_THE.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: FusedLinear | None = None

    def forward(self, x_TD: Tensor) -> Tensor:
        if self.gate_up_proj is not None and use_fused_projections() and self.gate_up_proj.intact:
            gate_TI, up_TI = self.gate_up_proj(x_TD).chunk(2, dim=-1)  # column halves of one [T, 2I] output
            return self.down_proj(silu_and_mul(gate_TI, up_TI))
        return self.down_proj(silu_and_mul(self.gate_proj(x_TD), self.up_proj(x_TD)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x_TD: Tensor, residual_TD: Tensor | None, cos_TE: Tensor, sin_TE: Tensor, attention: AttentionBackend
    ) -> tuple[Tensor, Tensor]:
        """(MLP output, residual stream without it): the stream is `residual_TD + x_TD` (`x_TD` alone if None)."""
        x_TD, residual_TD = self.input_layernorm.add_and_norm(x_TD, residual_TD)
        x_TD = self.self_attn(x_TD, cos_TE, sin_TE, attention)
        x_TD, residual_TD = self.post_attention_layernorm.add_and_norm(x_TD, residual_TD)
        return self.mlp(x_TD), residual_TD


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids_T: Tensor,
        positions_T: Tensor,
        attention: AttentionBackend,
        gradient_checkpointing: bool = False,
    ) -> Tensor:
        """Final-norm hidden states `[T, D]` for packed tokens: the trunk the policy's lm_head and the critic's value
        head both read."""
        x_TD, residual_TD = self.embed_tokens(input_ids_T), None
        cos_TE, sin_TE = self.rotary_emb(positions_T, x_TD.dtype)
        for layer in self.layers:
            if gradient_checkpointing and torch.is_grad_enabled():
                x_TD, residual_TD = checkpoint(layer, x_TD, residual_TD, cos_TE, sin_TE, attention, use_reentrant=False)
            else:
                x_TD, residual_TD = layer(x_TD, residual_TD, cos_TE, sin_TE, attention)
        return self.norm.add_and_norm(x_TD, residual_TD)[0]


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
        return self.model(input_ids_T, positions_T, attention, self.gradient_checkpointing)

    def compute_logits(self, h_TD: Tensor) -> Tensor:
        return self.lm_head(h_TD)

    def fuse_projections(self) -> CausalLM:
        """Give every layer one q/k/v GEMM and one gate/up GEMM for inference (module docstring). Call it before
        capturing CUDA graphs: the parameters move once, into the fused buffers. Idempotent."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj is None or not attn.qkv_proj.intact:
                attn.qkv_proj = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
            if mlp.gate_up_proj is None or not mlp.gate_up_proj.intact:
                mlp.gate_up_proj = FusedLinear([mlp.gate_proj, mlp.up_proj])
        return self

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> CausalLM:
        """Random weights in the model's real shape: what benchmarks run when real weights do not matter."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=generator)
        return self
