"""`nonstop train trainer.n_gpus_per_node=N [trainer.nnodes=M]`: which ranks run.

Under `torchrun` the launched ranks are used (and must agree with N × M when N is given). Without it, one node with
N > 1 launches its own N ranks through `torch.distributed.run` (what `torchrun --standalone --nproc-per-node=N`
does) running the same command line; several nodes need `torchrun` on every node (docs/multi-gpu.md).
"""

from __future__ import annotations

import os
import sys

from nonstop.config.trainer import TrainerConfig
from nonstop.dist.process_group import launched_by_torchrun


def check_torchrun_layout(trainer: TrainerConfig) -> None:
    """Under torchrun: `trainer.n_gpus_per_node` × `trainer.nnodes`, when given, must be the launched world."""
    if trainer.n_gpus_per_node is None:
        return
    world_size = int(os.environ["WORLD_SIZE"])
    if trainer.n_gpus_per_node * trainer.nnodes != world_size:
        raise ValueError(
            f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} x trainer.nnodes={trainer.nnodes} does not match the "
            f"{world_size} ranks torchrun launched; make them agree (or leave trainer.n_gpus_per_node unset)"
        )


def needs_own_launch(trainer: TrainerConfig, device_type: str, num_gpus: int) -> bool:
    """Whether this process must launch the ranks itself (one node, n_gpus_per_node > 1, not under torchrun)."""
    if launched_by_torchrun():
        check_torchrun_layout(trainer)
        return False
    if trainer.nnodes > 1:
        raise ValueError(
            f"trainer.nnodes={trainer.nnodes}: start nonstop with torchrun on every node, e.g. `torchrun "
            f"--nnodes={trainer.nnodes} --nproc-per-node={trainer.n_gpus_per_node or 'GPUS'} --node-rank=I "
            "--rdzv-backend=c10d --rdzv-endpoint=HOST:29500 -m nonstop train ...` (docs/multi-gpu.md)"
        )
    nproc = trainer.n_gpus_per_node or 1
    if device_type == "cuda" and nproc > num_gpus:
        raise ValueError(f"trainer.n_gpus_per_node={nproc} but only {num_gpus} CUDA devices are visible")
    return nproc > 1


def launch_local_ranks(nproc: int, program: list[str]) -> int:
    """Run `python PROGRAM` (e.g. `-m nonstop train ...`) on `nproc` ranks of this machine; returns 0, or 1 after
    printing which rank failed and why (the launcher stops every other rank)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", *program])
    try:
        run(args)
    except ChildFailedError as e:
        first, failure = e.get_first_failure()
        print(
            f"nonstop: rank {first} failed first (exit code {failure.exitcode}): {_summary(failure.message)}",
            file=sys.stderr,
        )
        others = sorted(rank for rank in e.failures if rank != first)
        if others:
            print(f"nonstop: ranks {others} stopped after it (their tracebacks are above)", file=sys.stderr)
        return 1
    return 0


def _summary(message: object) -> str:
    """The exception line of a failed rank: torchrun's error-file dict when the rank ran under `record`, else its
    text."""
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message).strip().splitlines()[-1] if str(message).strip() else "no error message (see the logs above)"
