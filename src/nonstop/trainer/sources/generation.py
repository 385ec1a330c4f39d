"""Generation on this process's engine while training waits (sync steps, validation): n samples per prompt, each
prompt's samples submitted for scoring as soon as they finish, the KV cache taken for the call and released after
it per the KV policy, and the weight-sync probe riding along in the same generate call.

Weight sync: on CPU the sync engine runs the trainer's own fp32 `CausalLM` (nothing to check); otherwise the engine
holds a copy, refreshed by `copy_to_engine` and checked by the probe (`actor/sync_logprob_diff`, sync_probe.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from nonstop.batching.batch import RolloutBatch, Sample
from nonstop.config import NonstopConfig
from nonstop.data import TokenizedPrompt
from nonstop.dist import DistInfo
from nonstop.dist.fsdp import full_named_parameters
from nonstop.models.lora import engine_weights, has_lora
from nonstop.rollout import LLM, RequestOutput, SamplingParams
from nonstop.trainer.actor import Actor
from nonstop.trainer.sampling import Sampling
from nonstop.trainer.scores import Scorer
from nonstop.trainer.sources.kv_policy import KvPolicy
from nonstop.trainer.sync_probe import probe_diff, probe_diff_beside, probe_engine, probe_params, probe_results


def copy_to_engine(model: torch.nn.Module, llm: LLM) -> None:
    """The trainer's weights into the engine, in place: nothing but the prefix cache when the engine runs the
    trainer's own model; under LoRA the merged weights (W + (alpha / r) B A); else every parameter, each gathered
    from its shards one at a time on several ranks."""
    if llm.model is model:
        llm.reset_prefix_cache()  # same tensors: only KV cached under the old weights is stale
        return
    llm.update_weights(engine_weights(model) if has_lora(model) else full_named_parameters(model))


def generate_samples(
    llm: LLM,
    prompts: Sequence[TokenizedPrompt],
    params: Sequence[SamplingParams],
    on_prompt_done: Callable[[int, list[Sample]], None] | None = None,
    extra_prompts: Sequence[list[int]] = (),
    extra_params: Sequence[SamplingParams] = (),
    on_extras_done: Callable[[list[RequestOutput]], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> RolloutBatch:
    """n samples per prompt with its own (seeded) params; `on_prompt_done(i, samples)` gets prompt i's samples as
    soon as they are all finished, in finishing order.

    `extra_prompts` / `extra_params`: more requests in the same generate call, which never reach `on_prompt_done` or
    the batch; `on_extras_done(outputs)` gets their outputs, in order, as soon as the last of them finishes. The
    weight-sync probe rides along this way instead of paying a generate call of its own, and scores its tokens while
    the rollout is still decoding. `progress`: `LLM.generate`'s live line."""
    by_prompt: dict[int, list[Sample]] = {}
    extras: dict[int, RequestOutput] = {}

    def finished(index: int, output: RequestOutput) -> None:
        if index >= len(prompts):
            extras[index - len(prompts)] = output
            if on_extras_done is not None and len(extras) == len(extra_prompts):
                on_extras_done([extras[j] for j in range(len(extra_prompts))])
            return
        by_prompt[index] = prompt_samples(prompts[index], output)
        if on_prompt_done is not None:
            on_prompt_done(index, by_prompt[index])

    llm.generate(
        [p.prompt_token_ids for p in prompts] + [list(p) for p in extra_prompts],
        list(params) + list(extra_params),
        on_finished=finished,
        progress=progress,
    )
    return RolloutBatch([s for i in range(len(prompts)) for s in by_prompt[i]], max(p.max_tokens for p in params))


def prompt_samples(prompt: TokenizedPrompt, output: RequestOutput) -> list[Sample]:
    row = prompt.row
    return [
        Sample(
            prompt_token_ids=list(prompt.prompt_token_ids),
            response_token_ids=list(completion.token_ids),
            rollout_logprobs=list(completion.logprobs),
            finish_reason=completion.finish_reason,
            uid=row.uid,
            data_source=row.data_source,
            ground_truth=row.ground_truth,
            extra_info=dict(row.extra_info),
            raw_prompt=list(row.prompt),
        )
        for completion in sorted(output.outputs, key=lambda c: c.index)
    ]


def colocated_generation(
    config: NonstopConfig, llm: LLM | None, actor: Actor, scorer: Scorer, sampling: Sampling, dist: DistInfo
) -> EngineGeneration | None:
    """Generation on `llm` for the trainer of `actor` (None without an engine: a split trainer rank). The KV cache is
    released for the update only where generation and training take turns on a GPU (`trainer.mode=sync`)."""
    if llm is None:
        return None
    rollout = config.actor_rollout_ref.rollout
    turns = config.trainer.mode == "sync" and rollout.free_cache_engine and actor.device.type == "cuda"
    kv = KvPolicy(llm, actor.device, enabled=turns)
    return EngineGeneration(llm, actor, scorer, sampling, kv, dist)


class EngineGeneration:
    def __init__(self, llm: LLM, actor: Actor, scorer: Scorer, sampling: Sampling, kv: KvPolicy, dist: DistInfo):
        """`actor`: the trainer's, whose policy the engine holds a copy of (or runs itself: `shares_weights`) and
        which scores the probe's trainer half."""
        self.llm, self.actor, self.scorer, self.sampling, self.kv, self.dist = llm, actor, scorer, sampling, kv, dist
        # Told each `generate` call's tokens and running samples (the progress bar's detail). Only `generate` tells
        # it: that runs on the trainer's thread; the overlap modes' rollouter steps the engine on its own and shows
        # nothing, so the bar is written from one thread.
        self.progress: Callable[[str], None] | None = None

    @property
    def model(self) -> torch.nn.Module:
        """The trainer's policy."""
        return self.actor.model

    @property
    def shares_weights(self) -> bool:
        return self.llm.model is self.model

    def generate(
        self,
        prompts: Sequence[TokenizedPrompt],
        params: SamplingParams,
        step: int,
        prefix: str,
        first_index: int = 0,
        probe: list[list[int]] | None = None,
    ) -> tuple[RolloutBatch, float | None]:
        """The batch, its samples submitted for scoring under `prefix` as they finish, prompt i seeded as
        `first_index + i` of `step` (Sampling.seeded); with `probe` prompts (an engine holding its own copy), the
        mean probe diff (else None): its requests ride along when `max_num_seqs` has room, else run first in a
        call of their own."""
        seeded = self.sampling.seeded(list(prompts), params, step, first_index)
        n = params.n
        probe_waits: list[Callable[[], torch.Tensor]] = []  # at most one: the wait for the probe's trainer half
        diff = None

        def submit(index: int, samples: list[Sample]) -> None:
            self.scorer.submit(prefix, index * n, samples)

        def score_probe(outputs: list[RequestOutput]) -> None:
            """The probe's trainer half as soon as its tokens are sampled, mid-rollout: its kernels queue behind the
            decode steps in flight instead of running after the rollout with the GPU waiting on the host. On one
            CUDA rank on a thread of its own, so the rollout's thread goes on launching decode steps meanwhile."""
            if self.probe_on_thread():
                probe_waits.append(probe_diff_beside(self.actor, probe, *probe_results(outputs)))
            else:
                diff_R = probe_diff(self.actor, probe, *probe_results(outputs))
                probe_waits.append(lambda: diff_R)

        probe = probe if probe and not self.shares_weights else []
        diffs, probe_error = [], None
        with self.engine_turn():
            try:
                if probe and self.llm.max_num_seqs - sum(p.n for p in seeded) < len(probe):
                    diff = self.probe(probe, step)  # riding along would queue the probe behind the rollout
                    probe = []
                batch = generate_samples(
                    self.llm, prompts, seeded, submit, extra_prompts=probe,
                    extra_params=probe_params(self.llm, probe, seed=step), on_extras_done=score_probe,
                    progress=self.progress,
                )  # fmt: skip
            finally:
                try:  # no probe thread outlives the rollout, even a failed one
                    diffs = [wait() for wait in probe_waits]
                except Exception as e:  # raised below, after the release, unless the rollout's own error is
                    probe_error = e
        if probe_error is not None:
            raise probe_error
        if probe:  # the trainer's half ran on the weights the probe's tokens were sampled with (no update since)
            diff = diffs[0].mean().item()
        return batch, diff

    @contextmanager
    def engine_turn(self) -> Iterator[None]:
        """The engine is the caller's to generate on: its KV cache allocated, and released after per the KV policy
        (no request may be left in it then: abort what is to be continued later)."""
        if self.kv.enabled:
            self.llm.resume()
        release = self.kv.enabled and not self.kv.keeps()
        self.model.eval()
        try:
            yield
        finally:
            if release:
                self.llm.release()
            self.kv.resident_in_training = not release

    def probe(self, prompts: list[list[int]], step: int) -> float:
        """Mean |engine − trainer| log-prob of the probe tokens, as a generate call of its own (sync_probe.py)."""
        responses, engine_logprobs = probe_engine(self.llm, prompts, seed=step)
        return probe_diff(self.actor, prompts, responses, engine_logprobs).mean().item()

    def probe_on_thread(self) -> bool:
        """The probe's trainer half on a thread of its own: one CUDA rank (sharded ranks' collectives keep order)."""
        return self.actor.device.type == "cuda" and self.dist.world_size == 1
