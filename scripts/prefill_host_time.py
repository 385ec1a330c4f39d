"""Host time of one eager prefill forward, measured on CPU with a tiny-width model so that compute is negligible.

The GRPO rollout's first step prefills 8 prompts of 128 tokens through a 24-layer Qwen2-family model eagerly (decode
runs in CUDA graphs); on the H200 its host side left the GPU 5-30% busy. This builds that step in the engine (8
prompts x `--prompt-len` tokens, n = 8, fused projections as the CUDA engine has them), captures the model inputs the
runner makes for it, and times the model forward alone: CPU time of this thread (torch on one thread), median over
`--repeats` after warm-up, per step and per layer.

Two paths:
- `reference`: the CPU path as it runs here (the plain-PyTorch references of every kernel).
- `cuda`: the CUDA path's host work emulated on CPU. The dispatchers are told the tensors are CUDA inference
  tensors, so the Triton wrappers, the FlashAttention call and every Python line between run as on the GPU, but the
  Triton launches and the FlashAttention op are stubbed to return at once (their outputs are garbage, and what
  triton's own launcher costs is not counted). What remains is nonstop's and torch's host work per layer.

`--profile` prints cProfile's top functions by self time.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/prefill_host_time.py --path cuda --prompt-len 2

Measured 2026-12-01, 2-core Intel Xeon VM, torch 2.13.0+cpu, triton 3.6.0, 24 layers, 8 prompts, medians of 200,
three interleaved runs of each tree (9737cb4 before, the commit that added this script after):
- `cuda`, 8 x 2 tokens (compute negligible): 3.98-4.10 -> 2.74-2.83 ms per step, 167 -> 115 us per layer. The
  FlashAttention call without `varlen_attn`'s Python custom op (~35 us of it per layer), the Triton wrappers' grid
  sizes without triton's constexpr functions (11 calls, ~1.5 us each), the prefill's max lengths once per step.
- `cuda`, 8 x 128 tokens (the CPU's GEMMs now count): 7.3-8.3 -> 5.9-6.1 ms per step.
- `reference`: unchanged (8 x 2: 8.4 ms; 8 x 128: 41 ms), as expected: its per-layer time is the references' own
  ops (a dozen elementwise ops per norm and rotary, one SDPA per sequence), which the CUDA path does not run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from nonstop.bench.shapes import tiny_config
from nonstop.models import CausalLM
from nonstop.rollout import LLMEngine, SamplingParams
from nonstop.rollout.engine_args import EngineArgs
from nonstop.rollout.paged_attention import PagedAttention


def prefill_inputs(model: CausalLM, num_prompts: int, prompt_len: int, n: int):
    """The engine's runner and the (ids, positions, metadata) of its first step, the prompts' prefill."""
    engine = LLMEngine(model, EngineArgs(max_num_seqs=num_prompts * n, num_kv_blocks=num_prompts * n * 16))
    runner = engine.model_runner
    captured = []
    attention_inputs = runner._attention_inputs
    runner._attention_inputs = lambda plan: captured.append(attention_inputs(plan)) or captured[-1]
    g = torch.Generator().manual_seed(0)
    for i in range(num_prompts):
        prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(str(i), prompt, SamplingParams(n=n, temperature=1.0, max_tokens=4, ignore_eos=True))
    engine.step()
    ids, positions, md = captured[0]
    assert md.num_prefill_tokens == ids.shape[0] == num_prompts * prompt_len
    return runner, ids, positions, md


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` returns at once."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def emulate_cuda_dispatch() -> None:
    """Route the model's kernels and the paged prefill attention down their CUDA branches, with no launch at the end."""
    import torch.nn.attention.varlen  # noqa: F401  (registers a flop formula on the real op: import it first)

    import nonstop.kernels.reshape_and_cache as reshape_and_cache
    import nonstop.kernels.reshape_and_cache_triton as reshape_and_cache_triton
    import nonstop.kernels.rms_norm as rms_norm
    import nonstop.kernels.rms_norm_triton as rms_norm_triton
    import nonstop.kernels.rotary as rotary
    import nonstop.kernels.rotary_triton as rotary_triton
    import nonstop.kernels.silu_mul as silu_mul
    import nonstop.kernels.silu_mul_triton as silu_mul_triton
    import nonstop.rollout.paged_attention as paged_attention

    for module in (reshape_and_cache, rms_norm, rotary, silu_mul):
        module.use_fused_kernel = lambda x: not torch.is_grad_enabled()
    paged_attention.use_fused_attention = lambda x: True
    rms_norm_triton._rms_norm_kernel = _NoLaunch()
    rotary_triton._rotary_qk_kernel = _NoLaunch()
    reshape_and_cache_triton._reshape_and_cache_kernel = _NoLaunch()
    silu_mul_triton._silu_and_mul_kernel = _NoLaunch()

    def flash_forward(q, k, v, *args, **kwargs):
        return torch.empty_like(q), torch.empty(q.shape[1], q.shape[0]), torch.empty(2), None, None

    torch.ops.aten._flash_attention_forward = flash_forward


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("reference", "cuda"), default="cuda")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CausalLM(tiny_config(num_hidden_layers=args.layers)).init_weights().eval().fuse_projections()
    with torch.inference_mode(False):
        runner, ids, positions, md = prefill_inputs(model, args.prompts, args.prompt_len, n=8)
    if args.path == "cuda":
        emulate_cuda_dispatch()

    def forward():
        return model(ids, positions, PagedAttention(runner.k_caches, runner.v_caches, md))

    for _ in range(20):
        forward()
    times = []
    for _ in range(args.repeats):
        start = time.thread_time_ns()
        forward()
        times.append((time.thread_time_ns() - start) / 1e6)
    ms = statistics.median(times)
    print(f"{args.path} path, {args.layers} layers, {args.prompts} x {args.prompt_len} tokens: median {ms:.3f} ms "
          f"per step, {1e3 * ms / args.layers:.1f} us per layer (torch {torch.__version__})")  # fmt: skip
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            forward()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
