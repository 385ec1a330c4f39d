"""The few collectives the trainer needs, each a no-op for a single rank so callers need no `if distributed`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nonstop.dist.process_group import current

T = TypeVar("T")


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place (it must live on the rank's device: CUDA under NCCL, CPU under gloo)."""
    info = current()
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=info.group)
    return tensor


def sum_over_ranks(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The sum over ranks of `tensor` wherever it lives (a copy, reduced on `device`: NCCL reduces CUDA tensors only);
    `tensor` itself for a single rank."""
    if not current().distributed:
        return tensor
    return all_reduce_sum_(tensor.to(device, copy=True)).to(tensor.device)


def all_reduce_max(value: int, device: torch.device) -> int:
    info = current()
    if not info.distributed:
        return value
    tensor = torch.tensor(value, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=info.group)
    return int(tensor.item())


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order."""
    info = current()
    if not info.distributed:
        return [obj]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, obj, group=info.group)
    return gathered


def on_every_rank(action: Callable[[], T], expected: type[Exception]) -> T:
    """`action()` on this rank, its outcome agreed by all: its result when it succeeded on every rank, else an error on
    every rank. One all-gather per call on every rank, whatever happened, so a rank that failed never leaves the others
    waiting in a collective it skipped (a DCP load), and ranks that act on the outcome (fall back, stop) act together.
    When every failure is an `expected` error, each rank raises `expected(message)`, the message naming each rank's
    failure (`_by_rank`); otherwise a rank that failed re-raises its own error and the others raise a
    RuntimeError naming the ranks that failed. A single rank: no collective, and an error is raised unchanged."""
    result, error = None, None
    try:
        result = action()
    except Exception as e:
        error = e
    if not current().distributed:
        if error is not None:
            raise error
        return result
    verdict = None if error is None else (isinstance(error, expected), str(error))
    verdicts = all_gather_objects(verdict)
    failed = {rank: v for rank, v in enumerate(verdicts) if v is not None}
    if not failed:
        return result
    message = _by_rank({rank: text for rank, (_, text) in failed.items()}, len(verdicts))
    if all(is_expected for is_expected, _ in failed.values()):
        raise expected(message) from error
    if error is not None and not isinstance(error, expected):
        raise error
    raise RuntimeError(f"stopped with the ranks that failed: {message}") from error


def _by_rank(messages: dict[int, str], world_size: int) -> str:
    """`rank 1: <message>`, ranks with the same message together (`ranks 0, 2: ...`), joined by `; `; the message
    alone when every one of `world_size` ranks reports it (a file all ranks read, damaged for all)."""
    ranks: dict[str, list[int]] = {}
    for rank, text in sorted(messages.items()):
        ranks.setdefault(text, []).append(rank)
    if len(ranks) == 1 and len(messages) == world_size:
        return next(iter(ranks))
    named = {text: ("rank " if len(r) == 1 else "ranks ") + ", ".join(map(str, r)) for text, r in ranks.items()}
    return "; ".join(f"{named[text]}: {text}" for text in ranks)


def send_object(obj: Any, dst: int, group: Any) -> None:
    """`obj` (picklable) to global rank `dst` over `group` (a gloo group: the bytes travel through CPU memory)."""
    dist.send_object_list([obj], dst=dst, group=group)


def recv_object(src: int, group: Any) -> Any:
    """The next object global rank `src` sent this rank over `group`."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """One metrics dict for the whole run from every rank's (`merge_metrics`)."""
    return merge_metrics(all_gather_objects(metrics))


def merge_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """`*/max` the maximum, `*/min` the minimum, `perf/total_num_tokens` the sum, anything else the mean over the
    ranks that report it (ranks hold equal numbers of samples, so a mean of per-rank sample means is the global
    sample mean)."""
    if len(per_rank) == 1:
        return per_rank[0]
    keys = sorted({k for m in per_rank for k in m})
    out = {}
    for key in keys:
        values = [m[key] for m in per_rank if key in m]
        if key.endswith("/max"):
            out[key] = max(values)
        elif key.endswith("/min"):
            out[key] = min(values)
        elif key == "perf/total_num_tokens":
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out
