"""When to verify: the `draft_rule` of speculative decoding, decided per launch in the drafting range.

A verify launch runs K rounds; a round yields each live sequence its kept tokens (1 + accepted drafts). A plain
launch runs K decode steps of one token each. A verify launch pays when its tokens per sequence per round beat what
a round costs in plain steps:

    verify iff  g  >=  MARGIN x t_round / t_plain

g is the kept tokens per live sequence per round of recent verify launches (an exponentially weighted mean of each
launch's `launch_gain`), t_round a verify launch's wall time per round, the mean of the last few (the pipeline's
period: verify launches chain like plain ones; a launch planned afresh also counts the device's idle time while the
host read the launch before and planned it, which a chain hides and the mean keeps), t_plain a plain decode step's,
the median of the last few, both measured in the range, and MARGIN a 10% hedge for what they leave out; the rule
needs no cost measured elsewhere. A launch's gain is
the harmonic mean of its rows' kept tokens per round, weighted by their live rounds, not the arithmetic one: the
generation ends with its last row, and a row's time to its end goes as 1 / its gain, so the mean time of a row, not
the mean gain, says what verifying saves.

Every so often a launch in the range does the other thing once (verify while the rule says plain; plain while it
says verify), so both times and g stay current: after `PROBE_EVERY` launches at first. Each direction keeps its own
interval, doubled (up to `MAX_PROBE_EVERY`) while its probes leave the decision as it was and brought back when one
changes it: a probe that verified and did not pay doubles the verify probes' interval, one that paid, or a launch
that verifies on the rule's own say, brings it back; verifying still paying against the plain step that a probe
towards plain timed (its own time: one time moves the median little) doubles the plain probes' interval, plain
decoding winning brings it back. So where verifying loses (a model that rambles) probes cost a few launches a run,
and where it pays the plain launches and the re-planned verify launch after them do too. A plain step's time is
learnt only from a plain launch with another launched behind it (the pipeline's period), so while none is known, and
after a probe towards plain, the rule runs two plain launches; a verify launch read with nothing behind it is timed
to its read from its launch, or, planned afresh, from the read before its planning (LLMEngine._keep_verified).

`always` verifies every launch in the range: for tests and for measuring acceptance.
"""

from __future__ import annotations

import statistics
from collections import deque

from nonstop.config.rollout import SpeculativeConfig

PROBE_EVERY = 16
MAX_PROBE_EVERY = 512
DECAY = 0.3  # weight of the newest launch in g
PRIOR_GAIN = 2.0  # g before any verify launch: verify once to measure it
# g must beat the cost by this much: what the rule's times leave out (switching from verifying to plain decoding
# re-plans, a chain's last launch) and their noise made gains just above the cost generate slower (dev log).
MARGIN = 1.1
TIMES_KEPT = 8


def launch_gain(kept: list[int], rounds: list[int]) -> float | None:
    """Kept tokens per round of a verify launch's rows (`kept` tokens in `rounds` live rounds, per row): their
    harmonic mean weighted by live rounds, sum(rounds) / sum(rounds / gain); None with no live row (a chain's last
    launch, behind the one that ended every row)."""
    time = sum(r * r / k for k, r in zip(kept, rounds, strict=True) if r)
    return sum(rounds) / time if time else None


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.always = config.draft_rule == "always"
        self.gain = PRIOR_GAIN
        self.round_times: deque[float] = deque(maxlen=TIMES_KEPT)
        self.plain_times: deque[float] = deque(maxlen=TIMES_KEPT)
        self.launches_since_probe = 0
        self.probe_every = PROBE_EVERY  # launches between probes towards verifying: doubles while they do not pay
        self.plain_probe_every = PROBE_EVERY  # ... towards plain: doubles while verifying still pays after them
        self.plain_probe_pending = False  # a probe towards plain ran; the next free decision judges it
        self.verifying = True  # the last decision on merit (before probing)
        self.probing = False  # this launch probes (decided by may_verify)
        self.probe_verify = False  # ... towards verifying (the rule said plain)
        self.hold_plain = 0  # plain launches still to run before the rule may verify (to time a plain step)

    def cost_ratio(self, plain_s: float | None = None) -> float | None:
        """t_round / t_plain from the recent launches (the mean round, the median plain step, or `plain_s`: a probe's
        own step); None until both were measured."""
        if not self.round_times or not self.plain_times:
            return None
        plain = statistics.median(self.plain_times) if plain_s is None else plain_s
        return statistics.fmean(self.round_times) / max(plain, 1e-9)

    def _pays(self, plain_s: float | None = None) -> bool:
        ratio = self.cost_ratio(plain_s)
        return ratio is None or self.gain >= MARGIN * ratio

    def may_verify(self) -> bool:
        """Once per launch in the drafting range: whether it verifies."""
        self.probing = self.probe_verify = False
        if self.always:
            return True
        if self.hold_plain:
            self.hold_plain -= 1
            return False
        if not self.plain_times:
            self.hold_plain = 1  # two plain launches: the first one's period is learnt at the second's read
            return False
        verify = self._pays()
        if self.plain_probe_pending:  # the plain probe's step is timed: would verifying pay against it?
            self.plain_probe_pending = False  # (judged by its own time: one time moves a median of several little)
            still = self._pays(self.plain_times[-1])
            self.plain_probe_every = min(2 * self.plain_probe_every, MAX_PROBE_EVERY) if still else PROBE_EVERY
        elif not verify:
            self.plain_probe_every = PROBE_EVERY  # plain on merit: once verifying pays again, probe at the base rate
        if verify != self.verifying:  # the decision changed on merit: the other way's probes count from here
            self.verifying, self.launches_since_probe = verify, 0
        self.probing = self.launches_since_probe >= (self.plain_probe_every if verify else self.probe_every)
        self.launches_since_probe = 0 if self.probing else self.launches_since_probe + 1
        self.probe_verify = self.probing and not verify
        if self.probing and verify:
            self.hold_plain = 1  # a probe towards plain: two plain launches, so that one is timed
            self.plain_probe_pending = True
        return verify != self.probing

    @property
    def decision(self) -> tuple[bool, bool]:
        """The last `may_verify`'s (probing, probe towards verifying): a launch read later (chained) reports it."""
        return self.probing, self.probe_verify

    def verified(self, tokens_per_round: float | None, round_s: float | None,
                 decision: tuple[bool, bool] | None = None) -> None:  # fmt: skip
        """A verify launch's outcome: kept tokens per live sequence per round (None: no live sequence, nothing
        learnt), its wall time per round (None: not a launch's time, e.g. it captured a CUDA graph), and the decision
        that launched it (`decision` when it was taken; default: the last one)."""
        probing, probe_verify = decision if decision is not None else self.decision
        if round_s is not None:
            self.round_times.append(round_s)
        if tokens_per_round is None:
            return
        self.gain += DECAY * (tokens_per_round - self.gain)
        if probe_verify:  # a probe towards verifying: did it pay?
            self.probe_every = PROBE_EVERY if self._pays() else min(2 * self.probe_every, MAX_PROBE_EVERY)
        elif not probing:
            self.probe_every = PROBE_EVERY  # verifying on merit: probes towards plain keep plain times current

    def decoded(self, num_steps: int, wall_s: float) -> None:
        """A plain decode launch of `num_steps` steps, in the drafting range, took `wall_s` (the pipeline's period)."""
        self.plain_times.append(wall_s / num_steps)
