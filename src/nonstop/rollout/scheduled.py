"""What the scheduler hands the engine and keeps count of: a step's batch (`ScheduledBatch`), a launched step's
sample rows (`SampledRows`), a step's outcome (`StepResult`) and the running counters (`SchedulerStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nonstop.rollout.sequence import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    # What the model runner needs of each sequence, noted while scheduling so the runner does not walk the
    # sequences again: the first position it computes (its num_cached_tokens), the token there (a placeholder while
    # its value is pending), and the sample rows it draws (0 for a prompt chunk short of the end, n for a group
    # parent whose prompt ends here).
    num_cached_tokens: list[int] = field(default_factory=list)
    first_token_ids: list[int] = field(default_factory=list)
    num_sample_rows: list[int] = field(default_factory=list)
    # Multi-step decode: how many decode steps each sequence runs in this launch (1..k, its first token is
    # `num_new_tokens`' 1); None for a single step.
    num_steps: list[int] | None = None
    # A verify launch (speculative decoding, rollout/spec/rounds.py): its rounds (0: not one), query slots per row,
    # and per sequence the positions its reserved KV blocks cover for the rounds.
    num_rounds: int = 0
    num_query: int = 0
    kv_capacity: list[int] | None = None

    @property
    def num_scheduler_steps(self) -> int:
        return max(self.num_steps) if self.num_steps else 1

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        cached = seq.num_cached_tokens
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.num_cached_tokens.append(cached)
        self.first_token_ids.append(seq.token_ids[cached])
        self.num_sample_rows.append(seq.num_samples if cached + num_new_tokens == seq.num_tokens else 0)

    def samples(self, i: int) -> bool:
        return self.num_sample_rows[i] > 0


@dataclass
class SchedulerStats:
    num_prompt_tokens: int = 0  # prompt tokens of the requests added (each prompt once, whatever n)
    num_prefill_tokens: int = 0  # prompt-position tokens actually computed (recomputation after preemption included)
    num_cached_tokens: int = 0  # tokens taken from the prefix cache instead of computed
    num_preemptions: int = 0
    num_steps: int = 0  # launches (a multi-step decode launch counts once)
    num_decode_steps: int = 0  # decode steps run (each step of a multi-step launch counts)
    num_generated_tokens: int = 0
    # Async scheduling: tokens computed past a sequence's end, because its stop was seen one step late, and dropped.
    num_discarded_tokens: int = 0
    # Wall time of `LLMEngine.step` calls (scheduling, launch, the one host sync, the host work on the sampled
    # tokens), split by whether the step launched computed any prompt tokens; what the rollout benchmark divides
    # bytes and tokens by. Under async scheduling a decode step's wall time is about its device time.
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    # Speculative decoding (verify rounds, rollout/spec/): decode steps run in the drafting range (verify rounds or
    # plain steps; each round or step of a launch counts), verify rounds with a live sequence, sequences computed in
    # them (a sequence once per round), those of them that had a draft, draft tokens verified, those the sampler
    # agreed with (accepted), the tokens the rounds kept (accepted + one per sequence, less any computed past a
    # stop), the verify launches' wall time and the plain launches'; verify launches, and those chained behind the
    # one before (launched before it was read).
    num_spec_range_steps: int = 0
    num_verify_steps: int = 0
    num_verify_seqs: int = 0
    num_drafting_seqs: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_tokens: int = 0
    verify_time_s: float = 0.0
    spec_plain_time_s: float = 0.0  # wall time of the plain decode launches in the drafting range
    num_verify_launches: int = 0
    num_chained_launches: int = 0
    # CUDA graphs captured (lazily, the first time a launch shape is needed) and the wall time of the launches that
    # captured them (inside the step times above): what a new shape costs a run that otherwise replays.
    num_graph_captures: int = 0
    graph_capture_time_s: float = 0.0

    def since(self, earlier: SchedulerStats) -> SchedulerStats:
        return SchedulerStats(**{k: v - getattr(earlier, k) for k, v in vars(self).items()})


@dataclass
class SampledRows:
    """A launched step's sample rows, in row order: each row's sequence and the index of its placeholder token."""

    seqs: list[Sequence] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    # The leading rows that name each sequence once (first-fill order); the rows after them (the later steps of a
    # multi-step launch) repeat those sequences.
    num_seqs: int = 0

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class StepResult:
    finished: list[Sequence] = field(default_factory=list)
    forked: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks to copy now
    sampled: SampledRows = field(default_factory=SampledRows)
    # A verify launch: per sequence, the rounds in which it was live and the tokens they kept (0 and 0 for one the
    # host had ended before the launch was read).
    rounds: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
