"""`LLM`: the offline facade in vLLM's shape, plus the RL surface (weight updates, memory release, abort/continue).

llm = LLM(model)  # a path, or a CausalLM whose parameters the engine then shares
outs = llm.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=256))
llm.update_weights(trainer_model.named_parameters())  # in place; the prefix cache is reset
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

from nonstop.models.transformer import CausalLM
from nonstop.rollout.engine_args import EngineArgs
from nonstop.rollout.llm_engine import LLMEngine
from nonstop.rollout.metrics import StatsWindow
from nonstop.rollout.outputs import RequestOutput
from nonstop.rollout.progress import GenerationProgress
from nonstop.rollout.sampling_params import SamplingParams
from nonstop.rollout.scheduled import SchedulerStats

KV_CACHE_TAG = "kv_cache"


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | CausalLM,
        tokenizer=None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        **engine_args,
    ):
        """`model` is a checkpoint path (HF directory or .gguf, loaded with its tokenizer) or a `CausalLM`, used as
        is: its parameters are the engine's (moved to `device` / cast to `dtype` in place only if those are given).
        `device=None` picks CUDA when available; `dtype=None` keeps a given model's dtype and loads paths in bf16 on
        GPU, fp32 on CPU. `engine_args` are `EngineArgs` fields (engine_args.py: `max_num_seqs`,
        `gpu_memory_utilization`, `num_scheduler_steps`, `cascade_attention`, ...), with the rollout config's
        defaults."""
        args = EngineArgs.from_kwargs(engine_args)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if isinstance(model, str | os.PathLike):
            from nonstop.models.loading import load_model

            dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
            model, loaded_tokenizer = load_model(os.fspath(model), dtype=dtype, device=dev)
            tokenizer = tokenizer or loaded_tokenizer
        elif device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        self.llm_engine = LLMEngine(model, args, tokenizer)
        self.tokenizer = tokenizer
        self.stats = SchedulerStats()  # counters of the last generate() call
        self.metrics: dict[str, float] = {}  # its `rollout/*` metrics (long tail, KV pressure, tokens)
        self._request_counter = itertools.count()

    @property
    def model(self) -> CausalLM:
        return self.llm_engine.model

    @property
    def max_num_seqs(self) -> int:
        return self.llm_engine.args.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    @property
    def kv_cache_bytes(self) -> int:
        """Device bytes the KV cache takes while allocated."""
        return self.llm_engine.model_runner.kv_cache_bytes

    def generate(
        self,
        prompts: str | list[str] | list[list[int]] | list[Mapping],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        on_finished: Callable[[int, RequestOutput], None] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. Text prompts are tokenized with `tokenizer.encode` (apply a
        chat template yourself); token-id prompts (lists, or dicts with "prompt_token_ids" / "input_ids") are used as
        given. `on_finished(prompt_index, output)` is called as soon as each prompt's n samples are done, while the
        rest are still generating (the trainer starts reward scoring there). `progress` is told the tokens generated
        and the samples running (`12,345 tok, 37/64 running`, progress.py) at most every `PROGRESS_INTERVAL_S`, and
        once more at the end."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling_params = sampling_params or SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        engine = self.llm_engine
        window = engine.stats_window()
        order = {}
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                request_id = str(next(self._request_counter))
                if isinstance(prompt, str):
                    if self.tokenizer is None:
                        raise ValueError("text prompts need a tokenizer; pass token ids or LLM(..., tokenizer=...)")
                    engine.add_request(request_id, self.tokenizer.encode(prompt), params, prompt=prompt)
                elif isinstance(prompt, Mapping):
                    # vLLM's TokensPrompt {"prompt_token_ids": [...]}, or a tokenizer's BatchEncoding.
                    ids = prompt.get("prompt_token_ids", prompt.get("input_ids"))
                    if ids is None:
                        raise ValueError(f"prompt dict needs 'prompt_token_ids', got keys {sorted(prompt)}")
                    engine.add_request(request_id, [int(t) for t in ids], params)
                else:
                    engine.add_request(request_id, list(prompt), params)
                order[request_id] = len(order)
        except Exception:
            engine.abort_request(list(order))  # leave the engine as it was
            window.close()
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate")
        live = None
        if progress is not None:
            live = GenerationProgress(progress, engine.scheduler, sum(p.n for p in sampling_params))
        outputs = []
        try:
            while engine.has_unfinished_requests():
                if live is not None:
                    live.tick()
                finished = engine.step()
                outputs += finished
                if on_finished is not None:
                    for output in finished:
                        on_finished(order[output.request_id], output)
                if bar is not None:
                    bar.update(len(finished))
        finally:
            engine.abort_request(list(order))  # a failed step must not leave this call's requests queued
            window.close()
            if bar is not None:
                bar.close()
        if live is not None:
            progress(live.line())
        self.stats = window.stats()
        self.metrics = window.pop()
        return sorted(outputs, key=lambda o: order[o.request_id])

    # -- streaming: requests added and stepped one engine step at a time (the trainer's rollouter) -----------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
        output_logprobs: list[float] | None = None,
        sample_index: int = 0,
    ) -> None:
        """Queue one request (`LLMEngine.add_request`: continuing a partial sample from its tokens and log-probs)."""
        self.llm_engine.add_request(
            request_id,
            prompt_token_ids,
            params,
            output_token_ids=output_token_ids,
            output_logprobs=output_logprobs,
            sample_index=sample_index,
        )

    def step(self) -> list[RequestOutput]:
        """One engine step; the requests it finished."""
        return self.llm_engine.step()

    def abort(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop these requests now; their partial outputs (`LLMEngine.abort_request`)."""
        return self.llm_engine.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.llm_engine.has_unfinished_requests()

    def stats_window(self) -> StatsWindow:
        """`rollout/*` metrics of the engine steps from now on: `pop()` returns them and starts again, `close()` ends
        the window. Several may be open at once (each `generate` call opens its own)."""
        return self.llm_engine.stats_window()

    # -- RL surface -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy new weights into the engine's parameter tensors in place (cast to their dtype, same addresses, so
        captured CUDA graphs stay valid), then reset the prefix cache, whose KV the old weights computed."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's is {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self.llm_engine.block_manager.reset_prefix_cache()

    def release(self, tags: Iterable[str] = (KV_CACHE_TAG,)) -> None:
        """Free GPU memory between rollouts (the trainer needs it). Tag "kv_cache": the KV cache and the CUDA graphs
        that captured its addresses. Requests must not be running."""
        tags = self._check_tags(tags)
        if KV_CACHE_TAG in tags:
            if self.llm_engine.has_unfinished_requests():
                raise RuntimeError("release(kv_cache) with unfinished requests; abort them first")
            self.llm_engine.model_runner.release_kv_cache()
            self.reset_prefix_cache()

    def resume(self, tags: Iterable[str] = (KV_CACHE_TAG,)) -> None:
        """Re-allocate what `release` freed (same size); CUDA graphs are re-captured at the next decode."""
        tags = self._check_tags(tags)
        runner = self.llm_engine.model_runner
        if KV_CACHE_TAG in tags and not runner.has_kv_cache:
            runner.allocate_kv_cache()
            self.reset_prefix_cache()

    @staticmethod
    def _check_tags(tags: Iterable[str]) -> set[str]:
        tags = {tags} if isinstance(tags, str) else set(tags)
        unknown = tags - {KV_CACHE_TAG}
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; supported: [{KV_CACHE_TAG!r}]")
        return tags
