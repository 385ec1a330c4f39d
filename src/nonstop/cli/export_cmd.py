"""`nonstop export CKPT --out DIR`: a trainer checkpoint as a Hugging Face model directory (transformers, vLLM and
nonstop load it)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint's policy as a Hugging Face model directory",
        description="Export the policy of a checkpoint as a Hugging Face model directory. CKPT is a checkpoint "
        "(RUN_DIR/checkpoints/global_step_N), a checkpoints directory or a run directory (then its latest "
        "checkpoint).",
    )
    parser.add_argument("checkpoint", metavar="CKPT")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="weight dtype of the export (default bfloat16; checkpoints hold fp32 master weights)",
    )
    parser.set_defaults(run=run)


def resolve_checkpoint(path: Path) -> Path:
    """A step directory as given, or the latest complete one under a checkpoints or run directory."""
    from nonstop.trainer.checkpoint import checkpoint_root, latest_checkpoint

    if (path / "actor" / "config.json").is_file():
        return path
    for root in (path, checkpoint_root(path)):
        if root.is_dir() and (found := latest_checkpoint(root)) is not None:
            return found
    raise FileNotFoundError(f"{path}: no checkpoint (expected global_step_N/actor/ or a run directory with one)")


def run(args: argparse.Namespace) -> int:
    import torch

    from nonstop.models.hf_loader import load_hf_model
    from nonstop.models.save import save_hf
    from nonstop.models.tokenizer import load_tokenizer

    ckpt = resolve_checkpoint(Path(args.checkpoint))
    actor_dir = ckpt / "actor"
    model = load_hf_model(actor_dir, dtype=getattr(torch, args.dtype))
    tokenizer = None
    if (actor_dir / "tokenizer_config.json").is_file() or (actor_dir / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(actor_dir)
    out = save_hf(model, args.out, tokenizer=tokenizer)
    note = "" if tokenizer is not None else " (the checkpoint has no tokenizer files; add them before use)"
    print(f"exported {ckpt} to {out}{note}")
    return 0
