"""The CUDA-graph launch shapes each step of a bench run captured: a capture costs many decode steps' time, so one
landing inside a timed step skews it, and the result should say which shapes did."""

from __future__ import annotations

from typing import Any


def graphs_of(trainer: Any):
    """The in-process engine's CUDA graphs (`DecodeGraphs`), or None (CPU, eager, a rollout on other ranks)."""
    llm = getattr(trainer, "llm", None)
    runner = getattr(getattr(llm, "llm_engine", None), "model_runner", None)
    return getattr(runner, "graphs", None)


class CapturedShapes:
    """Wraps `trainer.step` to list, per step, the launch shapes (`LaunchShape` fields) that step captured."""

    def __init__(self, trainer: Any):
        self.by_step: list[list[list]] = []
        step = trainer.step

        def recorded(*args, **kwargs):
            graphs = graphs_of(trainer)  # looked up each step: the engine may create or replace them
            known = set(graphs.graphs) if graphs is not None else set()
            try:
                return step(*args, **kwargs)
            finally:
                if graphs is not None:  # list(...): an overlap mode's rollouter thread may be capturing
                    self.by_step.append([list(shape) for shape in list(graphs.graphs) if shape not in known])

        trainer.step = recorded

    def report(self, result: dict[str, Any], steps: int) -> None:
        """Adds the first `steps` steps' lists to `result` when there were graphs."""
        if self.by_step:
            result["graph_shapes_captured_by_step"] = self.by_step[:steps]
