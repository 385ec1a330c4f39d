"""`nonstop bench lora`: GRPO steps of the sync trainer with full fine-tuning and with LoRA, in the same run.

Workload: `nonstop bench trainer`'s (a random-weight model in a real shape, default Qwen2.5-1.5B; prompts × n
completions forced to full length; one mini-batch, one epoch, no KL; bf16 compute), run once per variant:
- `full`: every weight trained, fp32 master weights and AdamW moments (16 bytes per parameter before activations);
- `lora`: adapters of rank `--rank` on `--target-modules`, fp32 frozen base (what `lora_rank` alone gives);
- `lora-bf16`: the same with the frozen base in bf16 (`fsdp_config.model_dtype=bfloat16`): the adapters stay fp32.
Reported per variant: median step time and its phases, peak memory allocated over the step and in the actor update
(the profiler's per-phase peaks), memory held between steps (trainer model, optimizer state, engine weights and, when
`free_cache_engine` is off, the KV cache), trainable and total parameters; then each LoRA variant's ratios to `full`.

On CPU (the test) every number is real but meaningless as a measurement; only the GPU results are.
"""

from __future__ import annotations

import argparse
import gc
import traceback
from pathlib import Path
from typing import Any

import torch

from nonstop.bench import trainer_inputs, trainer_step
from nonstop.models.config import ModelConfig

VARIANTS = ("full", "lora", "lora-bf16")


def variant_overrides(name: str, args: argparse.Namespace) -> list[str]:
    if name == "full":
        return []
    lora = [
        f"actor_rollout_ref.model.lora_rank={args.rank}",
        f"actor_rollout_ref.model.lora_alpha={args.alpha}",
        f"actor_rollout_ref.model.target_modules={args.target_modules}",
    ]
    if name == "lora-bf16":
        lora.append("actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16")
    return lora


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_variant(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`trainer_step.run_nonstop` with the variant's keys, plus what its trainer holds once the steps are done."""
    built = {}

    def keep(trainer) -> None:
        built["trainer"] = trainer

    overrides = [f"trainer.default_local_dir={work / f'run-{name}'}", *variant_overrides(name, args), *args.override]
    variant_args = argparse.Namespace(**{**vars(args), "override": overrides})
    result = trainer_step.run_nonstop(work, variant_args, prepare=keep)
    trainer = built.pop("trainer")
    params = list(trainer.model.parameters())
    result["trainable_params"] = sum(p.numel() for p in params if p.requires_grad)
    result["total_params"] = sum(p.numel() for p in params)
    result["model_bytes"] = tensor_bytes(params)
    state = trainer.actor.optimizer.state.values()
    result["optimizer_state_bytes"] = tensor_bytes(t for s in state for t in s.values() if torch.is_tensor(t))
    result["engine_weight_bytes"] = tensor_bytes(trainer.llm.model.parameters())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        result["held_memory_gb"] = torch.cuda.memory_allocated() / 2**30
    metrics = result["metrics"]
    result["peak_memory_gb"] = metrics.get("perf/max_memory_allocated_gb")
    result["peak_memory_update_actor_gb"] = metrics.get("perf/max_memory_allocated_gb/update_actor")
    return result


def run(model_config: ModelConfig, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Write the shared inputs once, then run each variant in order; a variant that raises is recorded with its error
    and the next still runs."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer_inputs.write_model_dir(model_config, work / "model", device)
    trainer_inputs.write_tokenizer_dir(model_config.vocab_size, work / "tokenizer")
    texts = trainer_inputs.prompt_texts(args.prompts, args.prompt_len, model_config.vocab_size)
    trainer_inputs.write_prompts(work / "prompts.jsonl", texts)
    trainer_inputs.write_reward_fn(work / "reward.py")
    result: dict[str, Any] = {"variants": {}}
    for name in args.variants:
        try:
            result["variants"][name] = run_variant(name, work, args)
        except Exception as e:
            traceback.print_exc()
            result["variants"][name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    full = result["variants"].get("full", {})
    for name, side in result["variants"].items():
        if name == "full" or "error" in side or "error" in full or not full:
            continue
        side["step_time_vs_full"] = side["step_s"] / full["step_s"]
        for key in ("peak_memory_gb", "peak_memory_update_actor_gb", "held_memory_gb"):
            if side.get(key) and full.get(key):
                side[f"{key.removesuffix('_gb')}_vs_full"] = side[key] / full[key]
    return result


def table(result: dict[str, Any]) -> str:
    header = f"{'':10} {'step s':>8} {'update s':>9} {'sync s':>7} {'peak GB':>8} {'update GB':>9} {'held GB':>8}"
    lines = [header + f" {'trainable':>12}"]
    for name, side in result["variants"].items():
        if "error" in side:
            lines.append(f"{name:10} failed: {side['error']}")
            continue
        m = side["metrics"]

        def gb(key: str, s=side) -> str:
            return f"{s[key]:.2f}" if s.get(key) is not None else "-"

        lines.append(
            f"{name:10} {side['step_s']:8.3f} {m.get('timing_s/update_actor', 0):9.3f} "
            f"{m.get('timing_s/update_weights', 0):7.3f} {gb('peak_memory_gb'):>8} "
            f"{gb('peak_memory_update_actor_gb'):>9} {gb('held_memory_gb'):>8} {side['trainable_params']:12,d}"
        )
    for name, side in result["variants"].items():
        if "step_time_vs_full" in side:
            ratios = ", ".join(
                f"{k.removesuffix('_vs_full')} {v:.2f}x" for k, v in side.items() if k.endswith("_vs_full")
            )
            lines.append(f"{name} vs full: {ratios}")
    return "\n".join(lines)


def variants(value: str) -> list[str]:
    names = [v for v in value.split(",") if v]
    if not names or any(v not in VARIANTS for v in names):
        raise argparse.ArgumentTypeError(f"variants are a comma list of {', '.join(VARIANTS)}; got {value!r}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nonstop bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", help="model shape from nonstop.bench.shapes")
    p.add_argument("--variants", type=variants, default=list(VARIANTS), help="what to run, in order")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (lora_rank)")
    p.add_argument("--alpha", type=float, default=64, help="LoRA alpha (lora_alpha)")
    p.add_argument("--target-modules", default="all-linear", help="target_modules: all-linear or a comma list")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--response-len", type=int, default=256, help="tokens per completion (forced)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, per variant")
    p.add_argument("--steps", type=int, default=5, help="timed steps, per variant")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of every variant")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every variant")
    p.add_argument("--work-dir", default=None, help="keep the model, data and runs here (default: a temp dir)")
    p.add_argument(
        "--out",
        nargs="?",
        const="auto",
        default=None,
        help="write the result as JSON: to this path, or with no path to bench/results/lora-<time>.json",
    )
    return p


def main(argv: list[str] | None = None, model_cfg: ModelConfig | None = None) -> int:
    """`model_cfg` replaces `--shape` (the CPU test's tiny model)."""
    args = parser().parse_args(argv)
    from nonstop.bench.env import default_result_path, environment, work_dir, write_result
    from nonstop.bench.shapes import model_config

    shape = args.shape if model_cfg is None else "custom"
    model_cfg = model_cfg or model_config(args.shape)
    env = environment()
    with work_dir(args.work_dir, "lora") as work:
        result = run(model_cfg, args, work)
    print(
        f"\n{shape}: rank {args.rank}, alpha {args.alpha}, {args.target_modules}; {args.prompts} prompts x "
        f"{args.n} completions x {args.response_len} tokens; {env.get('gpu', 'cpu')}, torch {env['torch']}"
    )
    print(table(result))
    failed = [name for name, side in result["variants"].items() if "error" in side]
    if args.out:
        keys = ("rank", "alpha", "target_modules", "prompts", "n", "prompt_len", "response_len", "warmup", "steps")
        payload = {
            "environment": env,
            "command": "nonstop bench lora " + " ".join(argv or []),
            "shape": shape,
            "workload": {k: getattr(args, k) for k in (*keys, "lr", "override")},
            **result,
        }
        write_result(default_result_path("lora") if args.out == "auto" else args.out, payload)
    return 1 if failed else 0
