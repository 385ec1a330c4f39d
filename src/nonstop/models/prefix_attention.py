"""Attention for prefix-grouped packing: each GRPO group packed as `[prompt | r1 | … | rn]`, its prompt computed once.

Inside a group, prompt tokens attend causally to the prompt; a token of response j attends to the whole prompt and
causally to response j, never to another response. Groups packed back to back never see each other. That is one
rule over two per-token labels, `document_T` (which group) and `segment_T` (0 on the prompt, j on response j):

    key k is visible to query q  ⇔  document[k] == document[q] and k <= q and segment[k] in (0, segment[q])

(k <= q inside one document means k is an earlier prompt token or an earlier token of q's own response, because the
prompt comes first.) A group of one response is plain causal attention, so the rule also covers ungrouped samples.

Two implementations of the rule:
- `reference_prefix_grouped_attention`: plain PyTorch, one SDPA call per group with an explicit boolean mask. What
  runs on CPU (FlexAttention has no CPU backward in torch 2.13) and what the GPU path is tested against.
- `flex_prefix_grouped_attention`: `torch.nn.attention.flex_attention` with a block mask, compiled on CUDA. Tokens are
  padded to a power-of-two bucket so compiled kernels are reused across micro-batches (a handful of shapes per run);
  a padding token sees only itself, so padding costs diagonal blocks only. The block mask is built once per
  micro-batch, on the first layer's call, and reused by every layer: from the host-known layout
  (`layout_block_mask`, tiles classified in models/prefix_layout.py), one copy to the device and no pass of the
  rule over token pairs. `prefix_grouped_block_mask` (`create_block_mask` over the rule) is its reference.

Legend: T packed tokens, P padded tokens (the bucket), H query heads, K key/value heads, E head dim, G group tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from nonstop.models.attention import autocast_inputs
from nonstop.models.prefix_layout import PrefixGroupLayout, block_tiles
from nonstop.models.transfer import concat_to_device

FLEX_BLOCK_SIZE = 128


def visible_mask(segment_qG: Tensor, segment_kG: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """The visibility rule (module docstring) within one document, broadcast over query and key labels."""
    return (k_pos <= q_pos) & ((segment_kG == 0) | (segment_kG == segment_qG))


def reference_prefix_grouped_attention(
    q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, cu_group_lens: list[int], segment_T: Tensor
) -> Tensor:
    """Plain PyTorch: per group, SDPA over its G tokens with the `[G, G]` boolean visibility mask."""
    out_THE = torch.empty_like(q_THE)
    for s, e in zip(cu_group_lens[:-1], cu_group_lens[1:], strict=True):
        seg_G = segment_T[s:e]
        pos_G = torch.arange(e - s, device=q_THE.device)
        mask_GG = visible_mask(seg_G[:, None], seg_G[None, :], pos_G[:, None], pos_G[None, :])
        q_HGE = q_THE[s:e].transpose(0, 1)
        k_KGE, v_KGE = k_TKE[s:e].transpose(0, 1), v_TKE[s:e].transpose(0, 1)
        o_HGE = F.scaled_dot_product_attention(q_HGE, k_KGE, v_KGE, attn_mask=mask_GG, enable_gqa=True)
        out_THE[s:e] = o_HGE.transpose(0, 1)
    return out_THE


def flex_bucket(num_tokens: int) -> int:
    """Padded length: the next power of two, at least one flex block."""
    return max(FLEX_BLOCK_SIZE, 1 << (num_tokens - 1).bit_length())


def padded_labels(document_T: Tensor, segment_T: Tensor) -> tuple[Tensor, Tensor]:
    """Labels padded to the bucket. Padding tokens are document -1 with a distinct non-zero segment each (above every
    real segment id), so each sees only itself: no fully masked row (no NaN), and only diagonal blocks computed."""
    T = document_T.shape[0]
    P = flex_bucket(T)
    document_P = torch.full((P,), -1, dtype=torch.int32, device=document_T.device)
    segment_P = torch.arange(P, 2 * P, dtype=torch.int32, device=document_T.device)
    document_P[:T], segment_P[:T] = document_T, segment_T
    return document_P, segment_P


def _padded_mask_mod(document_T: Tensor, segment_T: Tensor):
    """The bucket length and FlexAttention's mask_mod of the rule over the padded labels."""
    document_P, segment_P = padded_labels(document_T, segment_T)

    def mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_P[q_idx] == document_P[kv_idx]
        return same_doc & visible_mask(segment_P[q_idx], segment_P[kv_idx], q_idx, kv_idx)

    return document_P.shape[0], mask_mod


def prefix_grouped_block_mask(document_T: Tensor, segment_T: Tensor):
    """FlexAttention `BlockMask` of the visibility rule over the padded bucket, by `create_block_mask`: the reference
    for `layout_block_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    P, mask_mod = _padded_mask_mod(document_T, segment_T)
    # Compiled mask construction never materialises the [P, P] mask; eager (CPU tests) does, at small P.
    return create_block_mask(
        mask_mod, None, None, P, P, device=document_T.device, BLOCK_SIZE=FLEX_BLOCK_SIZE, _compile=document_T.is_cuda
    )


def layout_block_mask(layout: PrefixGroupLayout, document_T: Tensor, segment_T: Tensor):
    """`prefix_grouped_block_mask`'s `BlockMask`, tensor for tensor, with its tiles classified on the host from the
    layout and sent in one non-blocking copy; mask_mod (over the device labels) runs only inside partial tiles."""
    from torch.nn.attention.flex_attention import BlockMask

    assert layout.num_tokens == document_T.shape[0], "the layout does not describe these labels"
    P, mask_mod = _padded_mask_mod(document_T, segment_T)
    Q = P // FLEX_BLOCK_SIZE
    shapes, parts = [], []
    for tiles_QK in block_tiles(layout, Q, FLEX_BLOCK_SIZE):
        # create_block_mask's order: a row's tiles by ascending key block, then its other key blocks ascending.
        shapes += [(1, 1, Q), (1, 1, Q, Q)]
        parts += [tiles_QK.sum(axis=-1), np.argsort(~tiles_QK, axis=-1, kind="stable").ravel()]
    # Each tensor starts 128-byte aligned in the one buffer: compiled kernels assume aligned inputs and clone
    # misaligned ones on every call.
    padded = [np.pad(part.astype(np.int32), (0, -len(part) % 32)) for part in parts]
    flat = concat_to_device(padded, document_T.device)
    starts = np.cumsum([0] + [len(part) for part in padded[:-1]])
    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = (
        flat[start : start + len(part)].view(shape) for start, part, shape in zip(starts, parts, shapes, strict=True)
    )
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, BLOCK_SIZE=FLEX_BLOCK_SIZE, mask_mod=mask_mod
    )


_COMPILED_FLEX = None


def _flex_attention(q_hPE: Tensor, k_kPE: Tensor, v_kPE: Tensor, block_mask) -> Tensor:
    """Compiled on CUDA (the fused kernel; eager FlexAttention materialises scores). Eager elsewhere: CPU tests check
    the block mask through it, forward only."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q_hPE.is_cuda:
        if _COMPILED_FLEX is None:
            # One compiled entry per (bucket, dtype, grad mode): past dynamo's default of 8 entries it would silently
            # fall back to the eager path, which materialises [P, P] scores per head.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        fn = _COMPILED_FLEX
    return fn(q_hPE, k_kPE, v_kPE, block_mask=block_mask, enable_gqa=True)


def flex_prefix_grouped_attention(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, block_mask) -> Tensor:
    """FlexAttention over the tokens padded to `block_mask`'s bucket; returns the T real rows."""
    T = q_THE.shape[0]
    P = block_mask.shape[-2]

    def to_1HPE(x_TXE: Tensor) -> Tensor:
        return F.pad(x_TXE, (0, 0, 0, 0, 0, P - T)).transpose(0, 1).unsqueeze(0)

    # Inputs arrive in one dtype (autocast_inputs); autocast stays out of the compiled higher-order op.
    with torch.autocast(q_THE.device.type, enabled=False):
        o_1HPE = _flex_attention(to_1HPE(q_THE), to_1HPE(k_TKE), to_1HPE(v_TKE), block_mask)
    return o_1HPE[0, :, :T].transpose(0, 1)


@dataclass
class PrefixGroupedAttention:
    """The backend of a prefix-grouped micro-batch: FlexAttention on CUDA, the SDPA reference elsewhere."""

    cu_group_lens: list[int]  # [groups + 1] token offsets of the groups
    document_T: Tensor  # [T] int32, group index of each token
    segment_T: Tensor  # [T] int32, 0 on prompts, j on response j of a group
    layout: PrefixGroupLayout  # the same micro-batch described on the host: the block mask comes from it
    _block_mask: object = field(default=None, repr=False)

    def block_mask(self):
        """FlexAttention's block mask, built on the first layer's call and reused by every layer."""
        if self._block_mask is None:
            self._block_mask = layout_block_mask(self.layout, self.document_T, self.segment_T)
        return self._block_mask

    def __call__(self, layer_idx: int, q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor) -> Tensor:
        q_THE, k_TKE, v_TKE = autocast_inputs(q_THE, k_TKE, v_TKE)
        if q_THE.is_cuda:
            return flex_prefix_grouped_attention(q_THE, k_TKE, v_TKE, self.block_mask())
        return reference_prefix_grouped_attention(q_THE, k_TKE, v_TKE, self.cu_group_lens, self.segment_T)
