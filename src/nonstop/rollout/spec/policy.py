"""When to draft, and how much: the `draft_rule` of speculative decoding.

A verify step pays when the tokens it yields per sequence beat what its cost buys in plain decode steps:

    verify iff  1 + mean_i g_i  >=  t_verify / t_plain

g_i is sequence i's accepted draft tokens per verify step it took part in (an exponentially weighted mean, 0 for a
step where it had no draft; a new sequence starts from its group's or everyone's mean), t_verify and t_plain the
wall times of recent verify steps and plain decode steps (medians of the last few, both measured by the engine at
the batch sizes where it drafts), so the rule needs no constant measured elsewhere. In a verify step every sequence
drafts: the drafting range is where a step's cost hardly depends on its tokens, so a draft that may be rejected costs
about nothing, while one left out cannot shorten the sequence that ends last, which is what the generation waits for.
A sequence's draft length follows its outcomes between half the most and the most (a fully accepted draft lets the
next one grow by two, a rejection at position a caps it at a + 1, never under the half). Every so often a step in the
drafting range does the other thing once (verify while the rule says plain; plain while it says verify), so both
times and the acceptance stay current: after `PROBE_EVERY` steps at first; a probe that verified and did not pay
doubles the interval (up to `MAX_PROBE_EVERY`), one that paid, or a step that verifies on the rule's own say, brings
it back, so where verifying loses (a dear verify step, a model that rambles) the probes' cost shrinks to a few steps
a run instead of one step in `PROBE_EVERY`. While no verify step has been timed, a step with drafts verifies.
A plain step's time is learnt only when the step after it does not ask for drafts (asking reads the step in flight
with nothing behind it), so a probe towards plain, and the range's first steps while no plain step is timed, run two
plain steps.
Asking for drafts drains the async pipeline, so the rule asks only while the expected gain, at the share of recent
asks that verified, outweighs what an ask that finds nothing costs (`DRAIN_COST`).

`always` verifies every step that has a draft, at full length: for tests and for measuring acceptance.
"""

from __future__ import annotations

import statistics
from collections import deque

from nonstop.config.rollout import SpeculativeConfig

PROBE_EVERY = 16
MAX_PROBE_EVERY = 512
DECAY = 0.3  # weight of the newest outcome in g_i
PRIOR_GAIN = 1.0  # g of a sequence before any outcome, with no group or global history either
TIMES_KEPT = 8
# Asking for drafts reads the step in flight: an ask that then finds nothing worth verifying has cost the async
# pipeline about one plain step (the next launch waits for the host). Asks are weighed with their recent yield.
DRAIN_COST = 1.0  # plain steps
ASK_DECAY = 0.2  # weight of the newest ask in the yield


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.always = config.draft_rule == "always"
        self.max_draft = config.num_speculative_tokens
        self.min_draft = max(1, self.max_draft // 2)  # the shortest a sequence's draft length adapts down to
        self.gain: dict[int, float] = {}  # seq_id -> g
        self.cap: dict[int, int] = {}  # seq_id -> draft length cap
        self.global_gain = PRIOR_GAIN
        self.verify_times: deque[float] = deque(maxlen=TIMES_KEPT)
        self.plain_times: deque[float] = deque(maxlen=TIMES_KEPT)
        self.steps_since_probe = 0
        self.probe_every = PROBE_EVERY  # steps between probes: doubles while verifying probes do not pay
        self.probing = False  # this step probes (decided once per step, by may_verify)
        self.probe_verify = False  # ... towards verifying (the rule said plain)
        self.ask_yield = 1.0  # share of recent asks for drafts that verified
        # Plain steps still to run before the next ask: a plain step's time is learnt only when the step after it does
        # not ask either (an ask reads the step in flight with nothing behind it, which times no period).
        self.hold_plain = 0

    def draft_lengths(self, seq_ids: list[int]) -> list[int]:
        """The draft length each sequence gets if the step verifies: every sequence drafts (module docstring)."""
        if self.always:
            return [self.max_draft] * len(seq_ids)
        return [self.cap.get(s, self.max_draft) for s in seq_ids]

    def expected_gain(self, seq_ids: list[int], draft_lengths: list[int]) -> float:
        """Mean accepted tokens per sequence a verify step with these draft lengths is expected to add."""
        g = self.gain
        return sum(g.get(s, self.global_gain) for s, k in zip(seq_ids, draft_lengths, strict=True) if k) / len(seq_ids)

    def cost_ratio(self) -> float | None:
        """t_verify / t_plain from the recent steps; None until both were measured."""
        if not self.verify_times or not self.plain_times:
            return None
        return statistics.median(self.verify_times) / max(statistics.median(self.plain_times), 1e-9)

    def _worth_asking(self, seq_ids: list[int], draft_lengths: list[int]) -> bool:
        """Whether the expected gain of verifying these drafts, in plain steps, outweighs the pipelining an ask that
        finds no draft worth verifying loses, at the recent yield of asks (at yield 1: whether verifying pays)."""
        if not any(draft_lengths):
            return False
        ratio = self.cost_ratio()
        if ratio is None:
            return True  # no verify step timed yet (or only ones that captured a graph): verify, to measure one
        y = self.ask_yield
        return y * (1 + self.expected_gain(seq_ids, draft_lengths) - ratio) >= (1 - y) * DRAIN_COST

    def should_verify(self, seq_ids: list[int], draft_lengths: list[int]) -> bool:
        """Once the drafts exist: whether a step with these (`draft_lengths`, as proposed; all 0: never) verifies. A
        probe towards verifying verifies whatever it found."""
        if not any(draft_lengths):
            return False
        if self.always or self.probe_verify:
            return True
        ratio = self.cost_ratio()
        return ratio is None or (not self.probing and 1 + self.expected_gain(seq_ids, draft_lengths) >= ratio)

    def may_verify(self, seq_ids: list[int]) -> bool:
        """Once per step in the drafting range, before the drafts exist: whether to ask for drafts (the engine then
        reads the step in flight to draft from every token). Decides here whether the step probes, doing the opposite
        of the rule once every `probe_every` steps, so that reading the step in flight cannot change the decision
        between this call and the drafts."""
        self.probing = self.probe_verify = False
        if self.always:
            return True
        if self.hold_plain:
            self.hold_plain -= 1
            return False
        if not self.plain_times:
            self.hold_plain = 1  # two plain steps: the first one's time is learnt at the second's launch
            return False
        self.probing = self.steps_since_probe >= self.probe_every
        self.steps_since_probe = 0 if self.probing else self.steps_since_probe + 1
        ask = self._worth_asking(seq_ids, self.draft_lengths(seq_ids))
        self.probe_verify = self.probing and not ask
        if self.probing and ask:
            self.hold_plain = 1  # a probe towards plain: two plain steps, so that one is timed
        return ask != self.probing

    def asked(self, verified: bool) -> None:
        """The outcome of an ask for drafts: whether the step then verified."""
        self.ask_yield += ASK_DECAY * (float(verified) - self.ask_yield)

    def verified(self, seq_ids: list[int], drafts: list[int], accepted: list[int], wall_s: float | None) -> None:
        """A verify step's outcome: per sequence its draft length and accepted tokens; its wall time (None: not a
        step's time, e.g. it captured a CUDA graph)."""
        self._record_time(verify=True, wall_s=wall_s)
        if self.probe_verify:  # a probe towards verifying: did it pay?
            ratio = self.cost_ratio()
            if ratio is not None:
                paid = 1 + sum(accepted) / len(accepted) >= ratio
                self.probe_every = PROBE_EVERY if paid else min(2 * self.probe_every, MAX_PROBE_EVERY)
        elif not self.probing:
            self.probe_every = PROBE_EVERY  # verifying on merit: probes towards plain keep plain times current
        gain, cap = self.gain, self.cap
        for seq_id, k, a in zip(seq_ids, drafts, accepted, strict=True):
            old = gain.get(seq_id, self.global_gain)
            gain[seq_id] = old + DECAY * (a - old)
            if k:
                cap[seq_id] = min(self.max_draft, k + 2) if a == k else max(a + 1, self.min_draft)
        self.global_gain += DECAY * (sum(accepted) / len(accepted) - self.global_gain)

    def decoded(self, num_steps: int, wall_s: float) -> None:
        """A plain decode launch of `num_steps` steps, in the drafting range, took `wall_s`."""
        self._record_time(verify=False, wall_s=wall_s / num_steps)

    def _record_time(self, verify: bool, wall_s: float | None) -> None:
        if wall_s is not None:
            (self.verify_times if verify else self.plain_times).append(wall_s)

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.gain.pop(seq_id, None)
            self.cap.pop(seq_id, None)
