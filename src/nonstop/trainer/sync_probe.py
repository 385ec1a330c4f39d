"""The weight-sync probe (`actor/sync_logprob_diff`): after a sync the engine samples a few tokens at temperature 1
from fixed prompts, and the trainer scores the same tokens. Engine and trainer log-probs agree to bf16 noise when
the engine holds the trainer's weights, and differ by far more when a sync was missed. Split in an engine half and
a trainer half, since under split placement they run on different ranks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor

from nonstop.models.transfer import host_to_device
from nonstop.rollout import LLM, RequestOutput, SamplingParams

PROBE_PROMPTS, PROBE_TOKENS = 2, 16  # a few sampled tokens of the first step's first prompts


def probe_params(llm: LLM, prompts: list[list[int]], seed: int) -> list[SamplingParams]:
    """The engine half's requests: PROBE_TOKENS sampled tokens per prompt (fewer where max_model_len ends first)."""
    room = llm.max_model_len
    return [
        SamplingParams(
            temperature=1.0, max_tokens=min(PROBE_TOKENS, room - len(p)), ignore_eos=True, seed=seed, detokenize=False
        )
        for p in prompts
    ]


def probe_results(outputs: list[RequestOutput]) -> tuple[list[list[int]], list[float]]:
    """Each probe prompt's sampled tokens and, flat in the same order, their log-probs."""
    responses = [list(out.outputs[0].token_ids) for out in outputs]
    return responses, [lp for out in outputs for lp in out.outputs[0].logprobs]


def probe_engine(llm: LLM, prompts: list[list[int]], seed: int) -> tuple[list[list[int]], list[float]]:
    """The engine's half as a generate call of its own: each prompt's sampled tokens and, flat in the same order,
    their log-probs."""
    return probe_results(llm.generate(prompts, probe_params(llm, prompts, seed)))


def probe_diff(actor, prompts: list[list[int]], responses: list[list[int]], engine_logprobs: list[float]) -> Tensor:
    """The trainer's half (`actor.sequence_logprobs`, a collective over sharded trainer ranks): `[R]` |trainer −
    engine| per probed token, on the trainer's device. Nothing here waits for the GPU, so the sync trainer runs it
    while the rollout's decode steps are still queued."""
    pairs = list(zip(prompts, responses, strict=True))
    trainer_R = actor.sequence_logprobs(pairs).float()
    engine_R = host_to_device(torch.tensor(engine_logprobs, dtype=torch.float32), trainer_R.device)
    return (trainer_R - engine_R).abs()


def probe_diff_beside(
    actor, prompts: list[list[int]], responses: list[list[int]], engine_logprobs: list[float]
) -> Callable[[], Tensor]:
    """`probe_diff` on a thread of its own, on the caller's CUDA stream; returns the call that waits for its result
    (and raises what it raised). Its forward is hundreds of kernel launches: run on the rollout's thread mid-rollout,
    the host would launch them instead of the next decode steps, with the GPU idle (docs/dev-log.md); here they are
    launched while the rollout's thread waits on its sampled ids. One rank only (on sharded ranks the forward's
    collectives must keep their order with the rollout thread's)."""
    device, stream = actor.device, torch.cuda.current_stream(actor.device)
    result: dict[str, object] = {}

    def run() -> None:
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                result["diff"] = probe_diff(actor, prompts, responses, engine_logprobs)
        except BaseException as e:  # re-raised on the caller's thread by wait()
            result["error"] = e

    thread = threading.Thread(target=run, name="nonstop-sync-probe", daemon=True)
    thread.start()

    def wait() -> Tensor:
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["diff"]

    return wait
