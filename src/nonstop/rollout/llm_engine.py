"""The engine loop: requests in, one scheduled model step at a time, finished requests out.

Async scheduling (the default): `step` launches step k+1 before it reads step k's sampled tokens, and does step k's
host work while the device runs step k+1; a stop is seen one step late and costs one discarded token. Sampling does
not change (a token's noise depends only on its seed, sample index and position). Speculative decoding (rollout/spec/)
verifies only where few sequences run; a verify launch (k rounds on the device) chains like a decode step: the next one,
on the same rows, is launched before it is read.
docs/engine.md has the details.
"""

from __future__ import annotations

import operator
import random
import time
from dataclasses import dataclass, field

from nonstop.models.transformer import CausalLM
from nonstop.rollout.block_manager import BlockManager
from nonstop.rollout.engine_args import EngineArgs
from nonstop.rollout.metrics import StatsWindow, StepLogEntry
from nonstop.rollout.model_runner import ModelRunner
from nonstop.rollout.outputs import CompletionOutput, RequestOutput
from nonstop.rollout.sampling_params import SamplingParams
from nonstop.rollout.scheduled import SampledRows, ScheduledBatch, SchedulerStats
from nonstop.rollout.scheduler import Scheduler
from nonstop.rollout.sequence import FinishReason, Sequence
from nonstop.rollout.spec import Speculator
from nonstop.rollout.spec.policy import launch_gain
from nonstop.rollout.step_buffers import SampledStep
from nonstop.rollout.stop_strings import StopStrings


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    seqs: list[Sequence] = field(default_factory=list)  # grows to n when the group parent forks
    detokenize: bool = True

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.n and all(s.is_finished for s in self.seqs)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not processed yet."""

    sampled: SampledStep
    rows: SampledRows  # per sample row: the sequence and the index of its placeholder
    # A plain decode launch in speculative decoding's drafting range: its decode steps and when it was launched (the
    # draft rule weighs a verify round against it; see LLMEngine._process_in_flight).
    timed_steps: int = 0
    launched_at: float = 0.0  # a verify launch planned afresh: from the read before its planning (the device's idle)
    verify: ScheduledBatch | None = None  # a verify launch's batch (`sampled` is its `VerifyStep`)
    captured: bool = False  # ... which captured its CUDA graph
    decision: tuple[bool, bool] = (False, False)  # ... and the draft rule's decision that launched it


# Multi-step decode's default on CUDA, where chaining decode steps hides the host's per-step work (measured in
# bench/results/README.md); on CPU there is no device queue to keep ahead of, so 1.
CUDA_NUM_SCHEDULER_STEPS = 8


class LLMEngine:
    def __init__(self, model: CausalLM, args: EngineArgs, tokenizer=None):
        self.model, self.args, self.tokenizer = model, args, tokenizer
        self.max_model_len = args.max_model_len or model.config.max_position_embeddings
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len (a whole sequence is "
                f"prefilled in one step, recomputed ones included): {args.max_num_batched_tokens} < "
                f"{self.max_model_len}; raise max_num_batched_tokens or turn chunked prefill on"
            )
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.num_scheduler_steps = args.num_scheduler_steps or (CUDA_NUM_SCHEDULER_STEPS if on_cuda else 1)
        self.model_runner = ModelRunner(model, args, self.max_model_len, self.num_scheduler_steps)
        self.block_manager = BlockManager(self.model_runner.num_kv_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            model.config.eos_token_ids,
            num_scheduler_steps=self.num_scheduler_steps,
            enable_chunked_prefill=args.enable_chunked_prefill,
        )
        # Seeds for requests that bring none: drawn in admission order, so a whole run reproduces from `args.seed`.
        self.rng = random.Random(args.seed)
        self.requests: dict[str, _Request] = {}
        self.in_flight: _InFlight | None = None
        self.last_read_at = 0.0  # when the host last read a step's tokens (a plain step's cost is timed from then)
        # Requests that finished while `abort_request` drained the step in flight: returned by the next `step`.
        self.ready: list[RequestOutput] = []
        # Open `stats_window`s: each gets one entry per `step()`, the doctor's evidence for the long tail and KV
        # pressure.
        self.windows: list[StatsWindow] = []
        self.stop_strings = StopStrings(tokenizer)
        spec = args.speculative_config
        self.speculator = Speculator(spec) if spec.method != "off" else None
        self.kept_per_round: dict[int, float] = {}  # per sequence, in the last verify launch read

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def stats_window(self) -> StatsWindow:
        """A window onto the engine's counters and steps from now on (`pop` for its metrics, `close` when done)."""
        return StatsWindow(self.scheduler.stats, self.windows)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        output_token_ids: list[int] | None = None,
        output_logprobs: list[float] | None = None,
        sample_index: int = 0,
    ) -> None:
        """Queue a request. `output_token_ids`/`output_logprobs` continue a partial (aborted) sample: they count
        towards max_tokens/min_tokens, so re-adding with the request's original SamplingParams (n=1, and the
        sample's `sample_index` and seed for the same noise) generates exactly what the uninterrupted run would."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        vocab = self.model.config.vocab_size
        try:
            prompt_token_ids = [operator.index(t) for t in prompt_token_ids]  # ints, numpy or 0-d torch integers
        except TypeError:
            raise ValueError(f"request {request_id!r}: prompt token ids must be integers") from None
        if not all(0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"request {request_id!r}: prompt token ids must be in [0, {vocab})")
        outputs = list(output_token_ids or [])
        if outputs:
            if sampling_params.n != 1:
                raise ValueError(f"request {request_id!r}: continuing from output_token_ids needs n=1")
            if output_logprobs is None or len(output_logprobs) != len(outputs):
                raise ValueError(f"request {request_id!r}: give one output_logprobs entry per output token")
            if len(outputs) >= sampling_params.max_tokens:
                raise ValueError(
                    f"request {request_id!r}: {len(outputs)} output tokens already reach max_tokens="
                    f"{sampling_params.max_tokens}"
                )
        longest = len(prompt_token_ids) + sampling_params.max_tokens
        if longest > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt_token_ids)} tokens + max_tokens="
                f"{sampling_params.max_tokens} exceeds max_model_len={self.max_model_len}"
            )
        seed = sampling_params.seed if sampling_params.seed is not None else self.rng.getrandbits(63)
        seq = Sequence(
            request_id,
            prompt_token_ids,
            sampling_params,
            seed,
            sample_index=sample_index,
            num_samples=sampling_params.n,
            output_token_ids=outputs,
            output_logprobs=list(output_logprobs or []),
        )
        self.stop_strings.add(seq)
        self.scheduler.add(seq)
        self.requests[request_id] = _Request(
            request_id, prompt, list(prompt_token_ids), sampling_params.n, [seq], sampling_params.detokenize
        )
        self.scheduler.stats.num_prompt_tokens += len(prompt_token_ids)

    def step(self) -> list[RequestOutput]:
        """One model step; returns the requests that finished. Async: launches a step, then processes the one
        launched by the previous call, so a request is returned one call after the step that finished it."""
        if not self.model_runner.has_kv_cache:
            raise RuntimeError("the KV cache is released; call resume() before generating")
        start = time.perf_counter()
        outputs, self.ready = self.ready, []
        stats, spec, batch, chained = self.scheduler.stats, self.speculator, None, False
        idle_from = None  # a verify launch planned afresh: when the device ran out of work before it
        drained = False  # this step read the launch in flight before scheduling
        if spec is not None and spec.wants_verify(self.scheduler):
            batch = self._chained_verify()
            chained = batch is not None
            if not chained:
                drained = self.in_flight is not None
                outputs += self._process_in_flight()  # the rounds draft from every token of the running sequences
                # The device idles from the read just made (or now) until this launch starts: the host's work on the
                # launch read and its planning of this one are this launch's cost, which chained launches hide.
                idle_from = self.last_read_at if drained else time.perf_counter()
                rounds = (self.num_scheduler_steps, self.model_runner.verify.num_query_for(len(self.scheduler.running)))
                batch = self.scheduler.schedule(rounds)
        else:
            if self.in_flight is not None and self.in_flight.verify is not None:
                drained = True
                outputs += self._process_in_flight()  # the host's tokens are a whole verify launch behind
            batch = self.scheduler.schedule()
        if not batch.seqs and self.in_flight is None:
            assert self.scheduler.is_finished(), "unfinished requests but nothing could be scheduled"
            if not drained:
                return outputs
            # It read the last launch of a verify chain (on CUDA: waited for the device to run it): a step like the
            # plain read step that ends a batch, logged below ("" launch), not time outside every step.
        launched, verify, captured, num_seqs = None, batch.num_rounds > 0, False, len(batch.seqs)
        prefill = not verify and max(batch.num_new_tokens, default=0) > 1
        if batch.seqs:
            timed = not verify and not prefill and spec is not None and spec.in_range(self.scheduler)
            graphs = self.model_runner.graphs
            captures = graphs.num_captures if graphs is not None else 0
            launched_at = time.perf_counter()
            runner = self.model_runner
            try:
                if chained:
                    killed = [seq.is_finished for seq in batch.seqs]
                    sampled = runner.continue_verify(batch, killed)
                    num_seqs -= sum(killed)
                else:
                    sampled = runner.launch_verify(batch, self._group) if verify else runner.launch(batch)
            except BaseException:
                # Scheduling registered prefix-cache hashes for blocks this step never wrote.
                self.block_manager.reset_prefix_cache()
                raise
            # A launch that captured its CUDA graph took the capture's time, not a step's: the draft rule must not
            # weigh it (one captured verify launch would otherwise make verifying look too dear to ever try again).
            captured = graphs is not None and graphs.num_captures != captures
            if captured:
                stats.num_graph_captures += graphs.num_captures - captures
                stats.graph_capture_time_s += time.perf_counter() - launched_at
            timed = timed and not captured
            if verify:
                stats.num_verify_launches += 1
                stats.num_chained_launches += chained
                # Read behind the next launch of its chain (async), or now; its outcome teaches the draft rule.
                timed_from = launched_at if idle_from is None else idle_from
                launched = _InFlight(sampled, SampledRows(), 0, timed_from, batch, captured, spec.policy.decision)
                if not self.args.async_scheduling:
                    self.in_flight, launched = launched, None
                    outputs += self._process_in_flight()
            elif self.args.async_scheduling:
                result = self.scheduler.advance(batch)
                launched = _InFlight(sampled, result.sampled, sampled.num_steps if timed else 0, launched_at)
            else:
                result = self.scheduler.postprocess(batch, *sampled.read())
                self.last_read_at = time.perf_counter()
                if timed:
                    self._timed_plain(sampled.num_steps, self.last_read_at - launched_at)
                outputs += self._finished_outputs(result.finished)
            if not verify:
                self.model_runner.copy_blocks(result.block_copies)
                for child in result.forked:
                    self.requests[child.request_id].seqs.append(child)
                    self.stop_strings.add(child)
        # The previous step's host work, while the device runs the one just launched.
        # A launch that captured a graph held the host for the capture: the step read behind it has no period.
        outputs += self._process_in_flight(pipelined=bool(batch.seqs) and not captured)
        self.in_flight = launched
        if not self.requests:
            # Every request is done: what is still in flight was computed past their ends; drop it now rather than
            # leave a step running into the caller's next move (weight update, release).
            self._process_in_flight()
        elapsed = time.perf_counter() - start  # async: about one device step once the pipeline is full
        kind = "chained" if chained else "verify" if verify else "prefill" if prefill else "decode"
        kind = kind if batch.seqs else ""
        entry = StepLogEntry(elapsed, num_seqs, self.scheduler.kv_blocked, decode=not prefill, launch=kind)
        for window in self.windows:
            window.steps.append(entry)
        if verify:
            stats.decode_time_s += elapsed
            stats.verify_time_s += elapsed
        elif prefill:
            stats.prefill_time_s += elapsed
        else:
            stats.decode_time_s += elapsed
        return outputs

    def _chained_verify(self) -> ScheduledBatch | None:
        """The next verify launch chained behind the one in flight (async scheduling): the same rows, going on on the
        device from where that launch leaves them, so it is launched before that one is read and the host's work on
        a launch hides behind the next. None (read the launch in flight, plan afresh) when no verify launch is in
        flight, when the running sequences fill at most half the rows (planned afresh, they take a smaller CUDA graph
        and draft more tokens each within the token budget), when the launch's shape cannot hold another (its draft
        window), when every running sequence is expected to reach its max_tokens in the launch in flight, or when the
        KV blocks do not fit. Fewer rows that would draft one more token afresh, in a graph of about the same tokens,
        go on: a re-plan idles the device while the host reads and plans, and the extra draft token is rarely kept."""
        in_flight = self.in_flight
        if not self.args.async_scheduling or in_flight is None or in_flight.verify is None:
            return None
        batch, launcher = in_flight.verify, self.model_runner.verify
        running = len(self.scheduler.running)
        if 2 * running <= launcher.num_rows_for(len(batch.seqs)):
            return None
        if not launcher.can_continue(batch):
            return None
        # Rows expected to reach max_tokens within the launch in flight (at the kept tokens a round each had in the
        # last launch read, at least one) are done after it: a launch behind it would compute no live row, dearer
        # than planning afresh when the guess was wrong.
        K, rates = batch.num_rounds, self.kept_per_round
        if all(len(s.token_ids) + K * rates.get(s.seq_id, 1.0) >= s.max_num_tokens for s in self.scheduler.running):
            return None
        return self.scheduler.extend_rounds(batch)

    def _timed_plain(self, num_steps: int, wall_s: float, learn: bool = True) -> None:
        """A plain decode launch in the drafting range took `wall_s`; `learn`: a step time the draft rule weighs."""
        stats = self.scheduler.stats
        stats.num_spec_range_steps += num_steps
        stats.spec_plain_time_s += wall_s
        if learn:
            self.speculator.policy.decoded(num_steps, wall_s)

    def _group(self, seq: Sequence) -> list[Sequence]:
        return self.requests[seq.request_id].seqs

    def _process_in_flight(self, pipelined: bool = False) -> list[RequestOutput]:
        """Reads the step in flight and updates the sequences. `pipelined`: another step was launched behind it; only
        such a read teaches the draft rule a plain step's time: from when the device could start it (its launch, or the
        previous step's end, about the previous read, when that came later) to its read, i.e. the pipeline's period.
        Launch to read would span the next launch too; a read with nothing behind it (drafts wanted, the end of a
        batch) has no period."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return []
        if in_flight.verify is not None:
            return self._keep_verified(in_flight)
        sampled = in_flight.sampled.read()
        previous_read, self.last_read_at = self.last_read_at, time.perf_counter()
        if in_flight.timed_steps:
            wall_s = self.last_read_at - max(in_flight.launched_at, previous_read)
            self._timed_plain(in_flight.timed_steps, wall_s, learn=pipelined)
        finished = self.scheduler.update(in_flight.rows, *sampled)
        return self._finished_outputs(finished)

    def _keep_verified(self, in_flight: _InFlight) -> list[RequestOutput]:
        """Reads a verify launch and keeps what its rounds kept. The draft rule learns its gain and, unless it captured
        a CUDA graph, its time per round: from when the device could start it (as a plain step's; planned afresh, from
        the read before its planning: the device idled meanwhile) to its read. Read with nothing behind it (the chain
        ends), that time also holds the host's gap before the read: an overestimate, which errs towards plain
        decoding."""
        batch = in_flight.verify
        outcome = in_flight.sampled.read()
        previous_read, self.last_read_at = self.last_read_at, time.perf_counter()
        result = self.scheduler.keep_rounds(batch, outcome)
        self.model_runner.verify.kept(batch.seqs)
        wall_s = self.last_read_at - max(in_flight.launched_at, previous_read)
        round_s = None if in_flight.captured else wall_s / batch.num_rounds
        self.speculator.policy.verified(launch_gain(result.kept, result.rounds), round_s, in_flight.decision)
        rows = zip(batch.seqs, result.kept, result.rounds, strict=True)
        self.kept_per_round = {seq.seq_id: k / r for seq, k, r in rows if r}
        return self._finished_outputs(result.finished)

    def _finished_outputs(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The requests `finished` (the sequences an update ended) completes, once the stop strings found in the
        tokens it filled in have ended theirs too."""
        if self.stop_strings:
            hits = self.stop_strings.check()
            if hits:
                finished = finished + self.scheduler.finish_at(hits, FinishReason.STOP)
        done = [r for r in {s.request_id for s in finished} if self.requests[r].finished]
        outputs = []
        for request_id in sorted(done):
            request = self.requests.pop(request_id)
            outputs.append(self._output(request))
            if self.speculator is not None:
                self.model_runner.verify.finished(request_id, request.prompt_token_ids,
                                                  [c.token_ids for c in outputs[-1].outputs])  # fmt: skip
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.ready)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop these requests now. Returns their partial outputs, in the order the ids were given (tokens and
        log-probs so far; unfinished samples get finish_reason "abort"; a request aborted before its prompt was
        prefilled returns n empty samples). The step in flight is processed first, so no token is pending; a request
        it finished is returned here as finished."""
        order = {r: i for i, r in enumerate([request_ids] if isinstance(request_ids, str) else request_ids)}
        self.ready += self._process_in_flight()
        outputs = [o for o in self.ready if o.request_id in order]
        self.ready = [o for o in self.ready if o.request_id not in order]
        self.scheduler.abort(set(order))
        for request_id in order:
            request = self.requests.pop(request_id, None)
            if request is not None:
                outputs.append(self._output(request))
                if self.speculator is not None:
                    self.model_runner.verify.finished(request_id, request.prompt_token_ids, None)
        return sorted(outputs, key=lambda o: order[o.request_id])

    def _output(self, request: _Request) -> RequestOutput:
        seqs = sorted(request.seqs, key=lambda s: s.sample_index)
        if len(seqs) < request.n:  # aborted before the fork: every sample is the parent's (empty) state
            seqs = seqs + [seqs[0]] * (request.n - len(seqs))
        detokenize = request.detokenize and self.tokenizer is not None
        outputs = [
            CompletionOutput(
                index=i,
                text=self._text(s, detokenize),
                token_ids=s.output_token_ids,
                logprobs=list(s.output_logprobs),
                finish_reason=s.finish_reason,
            )
            for i, s in enumerate(seqs)
        ]
        finished = all(c.finish_reason is not None for c in outputs)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished)

    def _text(self, seq: Sequence, detokenize: bool) -> str:
        """The sample's text ("" without `detokenize`): cut before the stop string that ended it, if one did."""
        text = self.stop_strings.text(seq)
        if not detokenize:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if text is None else text
