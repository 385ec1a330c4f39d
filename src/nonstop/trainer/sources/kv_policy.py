"""`rollout.free_cache_engine` on CUDA: whether the engine's KV cache is released for the update or kept.

verl releases it every step. Releasing also returns the trainer's cached blocks to the driver (`empty_cache`), which
the next update then takes back with cudaMalloc; so a small cache the update has room beside is kept: at most
KEEP_KV_MAX_FRACTION of the GPU, and the last training peak plus the cache under KEEP_KV_HEADROOM of it. The first
step always releases, and measures the update's peak without the cache. Measured effect: docs/dev-log.md.
"""

from __future__ import annotations

import torch

from nonstop.rollout import LLM

KEEP_KV_MAX_FRACTION = 0.05
KEEP_KV_HEADROOM = 0.8
PHASE_PEAK = "perf/max_memory_allocated_gb/"
# Phases whose peaks say nothing about the update's room: those that run the engine (the cache is allocated there
# anyway) and the whole step, which encloses them.
ENGINE_PHASES = ("gen", "testing", "step")  # "testing": validation, under verl's timing name


def training_peak_bytes(metrics: dict[str, float]) -> int | None:
    """The step's peak allocated bytes outside the phases that run the engine; None without CUDA memory metrics."""
    peaks = [v for k, v in metrics.items() if k.startswith(PHASE_PEAK) and k[len(PHASE_PEAK) :] not in ENGINE_PHASES]
    return int(max(peaks) * 2**30) if peaks else None


def keeps_kv_cache(kv_bytes: int, total_bytes: int, training_peak_bytes: int, kv_was_resident: bool) -> bool:
    """Whether the update can run beside the KV cache: a small cache (≤ KEEP_KV_MAX_FRACTION of the GPU) whose bytes
    plus the last training peak stay under KEEP_KV_HEADROOM of it. The peak already holds the cache when it stayed
    resident through that step."""
    peak = training_peak_bytes + (0 if kv_was_resident else kv_bytes)
    return kv_bytes <= KEEP_KV_MAX_FRACTION * total_bytes and peak <= KEEP_KV_HEADROOM * total_bytes


class KvPolicy:
    """The release decision of one engine, and what it needs from the previous step."""

    def __init__(self, llm: LLM, device: torch.device, enabled: bool):
        """`enabled`: `free_cache_engine` on a CUDA device with generation and training taking turns (sync)."""
        self.llm, self.device, self.enabled = llm, device, enabled
        # Peak allocated bytes of the last step's training phases, and whether the cache stayed through them.
        self.training_peak_bytes: int | None = None
        self.resident_in_training = False

    def keeps(self) -> bool:
        """`free_cache_engine`, except for a cache the update does not need the room of (`keeps_kv_cache`)."""
        if self.training_peak_bytes is None:
            return False
        kv_bytes = self.llm.kv_cache_bytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        return keeps_kv_cache(kv_bytes, total, self.training_peak_bytes, self.resident_in_training)

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Read the finished step's phase peaks; `rollout/kv_cache_released` when the policy is on."""
        self.training_peak_bytes = training_peak_bytes(metrics)
        return {"rollout/kv_cache_released": float(not self.resident_in_training)} if self.enabled else {}
