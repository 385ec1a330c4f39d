"""`nonstop export CKPT --out DIR`: a trainer checkpoint as a Hugging Face model directory (transformers, vLLM and
nonstop load it), or, for a LoRA run, as a PEFT adapter directory (`peft.PeftModel.from_pretrained` loads it on the
base model); `--merge` folds the adapter into the base and writes a full model instead. A checkpoint of several
ranks (`dcp/` shards) is gathered into full weights in this one process."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint's policy as a Hugging Face model or PEFT adapter directory",
        description="Export the policy of a checkpoint as a Hugging Face model directory, or a LoRA checkpoint as a "
        "PEFT adapter directory (adapter_config.json + adapter_model.safetensors). CKPT is a checkpoint "
        "(RUN_DIR/checkpoints/global_step_N), a checkpoints directory or a run directory (then its latest "
        "checkpoint).",
    )
    parser.add_argument("checkpoint", metavar="CKPT")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="weight dtype of the export (default: bfloat16 for a model; an adapter keeps its fp32 weights)",
    )
    parser.add_argument(
        "--merge", action="store_true", help="LoRA checkpoint: write the base with the adapter merged, as a full model"
    )
    parser.add_argument(
        "--base",
        default=None,
        metavar="PATH",
        help="with --merge: the base model (default: the adapter's base_model_name_or_path, the run's model.path)",
    )
    parser.set_defaults(run=run)


def resolve_checkpoint(path: Path) -> Path:
    """A step directory as given, or the newest usable one under a checkpoints or run directory (a newer one with a
    truncated or corrupt file is skipped with a warning naming the file)."""
    from nonstop.models.peft_format import is_adapter_dir
    from nonstop.trainer.checkpoint import checkpoint_root, newest_usable_checkpoint

    if (path / "actor" / "config.json").is_file() or is_adapter_dir(path / "actor"):
        return path
    for root in (path, checkpoint_root(path)):
        if root.is_dir() and (found := newest_usable_checkpoint(root)) is not None:
            return found
    raise FileNotFoundError(f"{path}: no checkpoint (expected global_step_N/actor/ or a run directory with one)")


def run(args: argparse.Namespace) -> int:
    import torch

    from nonstop.models.peft_format import is_adapter_dir
    from nonstop.models.tokenizer import load_tokenizer

    if args.base and not args.merge:
        raise ValueError("--base is the model an adapter is merged into; it needs --merge")
    ckpt = resolve_checkpoint(Path(args.checkpoint))
    actor_dir = ckpt / "actor"
    dtype = getattr(torch, args.dtype) if args.dtype else None
    tokenizer = None
    if (actor_dir / "tokenizer_config.json").is_file() or (actor_dir / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(actor_dir)
    if is_adapter_dir(actor_dir) and not args.merge:
        out = export_adapter(actor_dir, Path(args.out), dtype)
        print(f"exported the LoRA adapter of {ckpt} to {out} (PEFT format; --merge writes a full model)")
        return 0
    if args.merge and not is_adapter_dir(actor_dir):
        raise ValueError(f"{ckpt} holds full weights, not a LoRA adapter: there is nothing to merge")
    out = export_model(actor_dir, Path(args.out), dtype or torch.bfloat16, tokenizer, args.base)
    note = "" if tokenizer is not None else " (the checkpoint has no tokenizer files; add them before use)"
    print(f"exported {ckpt} to {out}{note}")
    return 0


def export_adapter(actor_dir: Path, out: Path, dtype) -> Path:
    """The adapter directory as trained, its tensors cast to `dtype` when given; tokenizer files come along."""
    from safetensors.torch import load_file

    from nonstop.models.peft_format import ADAPTER_WEIGHTS_FILE
    from nonstop.models.save import save_safetensors

    out.mkdir(parents=True, exist_ok=True)
    for file in actor_dir.iterdir():
        if file.is_file() and file.name != ADAPTER_WEIGHTS_FILE:
            shutil.copy2(file, out / file.name)
    weights = load_file(actor_dir / ADAPTER_WEIGHTS_FILE)
    weights = {k: v.to(dtype) if dtype is not None else v for k, v in weights.items()}
    save_safetensors(weights, out / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
    return out


def export_model(actor_dir: Path, out: Path, dtype, tokenizer, base: str | None):
    """A full HF directory: the checkpoint's weights, or its adapter merged into the base model."""
    import torch

    from nonstop.dist.checkpoint import SHARDED_DIR
    from nonstop.models.gguf_loader import load_gguf_model
    from nonstop.models.hf_loader import load_hf_model
    from nonstop.models.hub import resolve_model_path
    from nonstop.models.loading import default_model_path
    from nonstop.models.lora import merge_lora
    from nonstop.models.peft_format import ADAPTER_CONFIG_FILE, is_adapter_dir, load_adapter
    from nonstop.models.save import save_hf

    if (actor_dir.parent / SHARDED_DIR).is_dir():
        return save_hf(load_sharded_policy(actor_dir, dtype), out, tokenizer=tokenizer)
    if not is_adapter_dir(actor_dir):
        return save_hf(load_hf_model(actor_dir, dtype=dtype), out, tokenizer=tokenizer)
    base = base or json.loads((actor_dir / ADAPTER_CONFIG_FILE).read_text()).get("base_model_name_or_path")
    path = resolve_model_path(base) if base else default_model_path()  # null: the run trained the embedded model
    # Merged in fp32, cast once when saving.
    model = load_gguf_model(path, torch.float32) if path.suffix == ".gguf" else load_hf_model(path, torch.float32)
    merge_lora(load_adapter(model, actor_dir))
    return save_hf(model, out, tokenizer=tokenizer, dtype=dtype)


def load_sharded_policy(actor_dir: Path, dtype):
    """The policy of a checkpoint saved on several ranks: the full weights gathered from the step's `dcp/` shards into
    the model `actor/config.json` describes, in `dtype`."""
    from nonstop.dist.checkpoint import SHARDED_DIR, load_full_weights
    from nonstop.models.hf_loader import check_checkpoint, empty_model, model_from_tensors, read_hf_config

    weights = load_full_weights(actor_dir.parent / SHARDED_DIR, dtype)
    model = empty_model(read_hf_config(actor_dir))
    check_checkpoint(model, {name: tuple(t.shape) for name, t in weights.items()}, str(actor_dir.parent))
    return model_from_tensors(model, weights.items(), dtype, "cpu")
