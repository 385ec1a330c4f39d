"""The rule that decides when a verify launch pays (rollout/spec/policy.py), on hand-computed decisions."""

import pytest

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout.spec.policy import DECAY, MARGIN, MAX_PROBE_EVERY, PRIOR_GAIN, PROBE_EVERY, DraftPolicy


def policy(rule="auto") -> DraftPolicy:
    return DraftPolicy(SpeculativeConfig(method="suffix", draft_rule=rule))


def test_always_verifies_every_launch():
    p = policy("always")
    assert all(p.may_verify() for _ in range(3))


def test_two_plain_launches_come_first_then_a_verify_launch_to_measure_one():
    """A plain step's time is learnt only from a plain launch read behind another: two plain launches run before
    any verify launch; with no round timed yet, the next one verifies."""
    p = policy()
    assert not p.may_verify() and not p.may_verify()
    p.decoded(num_steps=8, wall_s=8.0)
    assert p.cost_ratio() is None and p.may_verify()


def test_auto_verifies_while_the_kept_tokens_beat_the_measured_cost():
    p = policy()
    p.decoded(num_steps=8, wall_s=8.0)  # 1 s a plain step
    for _ in range(20):
        p.verified(tokens_per_round=2.0, round_s=1.5)
    assert p.cost_ratio() == pytest.approx(1.5) and p.gain == pytest.approx(2.0, abs=1e-3)
    assert p.may_verify()  # 2 tokens a round >= 1.5
    for _ in range(20):
        p.verified(tokens_per_round=1.2, round_s=1.5)
    assert not p.may_verify()  # 1.2 < 1.5


def test_a_launch_that_captured_a_graph_teaches_tokens_but_not_cost():
    p = policy()
    p.decoded(num_steps=8, wall_s=8.0)
    p.verified(tokens_per_round=3.0, round_s=None)
    assert p.cost_ratio() is None and p.gain == pytest.approx(PRIOR_GAIN + DECAY * (3.0 - PRIOR_GAIN))
    p.verified(tokens_per_round=3.0, round_s=1.5)
    assert p.cost_ratio() == pytest.approx(1.5)


def run(p: DraftPolicy, launches: int, tokens: float, round_s: float) -> list[int]:
    """The launches that verified, plain ones taking 1 s a step."""
    verified_at = []
    for i in range(launches):
        if p.may_verify():
            verified_at.append(i)
            p.verified(tokens, round_s)
        else:
            p.decoded(num_steps=1, wall_s=1.0)
    return verified_at


def test_auto_probes_the_other_way_less_often_while_probes_do_not_pay():
    """Where verifying never pays, a probe verifies after PROBE_EVERY plain launches, then after twice as many each
    time, up to MAX_PROBE_EVERY; a probe that pays brings the interval back to PROBE_EVERY."""
    p = policy()
    p.plain_times.extend([1.0] * 4)
    p.round_times.extend([3.0] * 4)
    p.gain = 1.0  # verifying never pays: 1 < 3
    at = run(p, 4000, tokens=1.0, round_s=3.0)
    gaps = [b - a - 1 for a, b in zip([-1, *at[:-1]], at, strict=True)]  # plain launches before each probe
    expected = [min(PROBE_EVERY << i, MAX_PROBE_EVERY) for i in range(len(gaps))]
    assert gaps == expected and gaps[-1] == MAX_PROBE_EVERY and len(at) <= 4000 / PROBE_EVERY / 8
    # Rounds get cheap and drafts good: the next probe pays, and the rule verifies on merit from then on.
    p.round_times.extend([1.2] * 8)
    at = run(p, MAX_PROBE_EVERY + 1, tokens=3.0, round_s=1.2)
    assert p.probe_every == PROBE_EVERY and len(at) > MAX_PROBE_EVERY / 2


def test_a_launch_that_verifies_on_merit_brings_the_probe_interval_back():
    p = policy()
    p.plain_times.extend([1.0] * 4)
    p.round_times.extend([1.5] * 4)
    p.probe_every, p.gain = MAX_PROBE_EVERY, 3.0  # backed off; 3 >= 1.5: verifying pays
    assert p.may_verify() and not p.probing
    p.verified(tokens_per_round=3.0, round_s=1.5)
    assert p.probe_every == PROBE_EVERY


def test_where_verifying_loses_the_rule_settles_on_plain_and_keeps_plain_times_current():
    """1.3 tokens a round at 2 plain steps a round: after the first launches the rule runs plain, verifying only
    in the backed-off probes."""
    p = policy()
    at = run(p, 2000, tokens=1.3, round_s=2.0)
    assert p.cost_ratio() == pytest.approx(2.0) and at[0] == 2  # two plain launches, then a verify launch
    assert len([i for i in at if i >= 100]) <= 1900 / PROBE_EVERY / 4


def test_a_probe_read_after_the_next_decision_still_counts_as_a_probe():
    """A chained launch is read after the rule decided the next launch: its outcome is judged by the decision that
    launched it. A probe towards verifying that did not pay doubles the interval even when read after a plain
    decision (judged by the later decision it would look like verifying on merit and reset the interval)."""
    p = policy()
    p.plain_times.extend([1.0] * 4)
    p.round_times.extend([3.0] * 4)
    p.gain = 1.0  # verifying does not pay: 1 < 3
    while not p.may_verify():
        p.decoded(num_steps=1, wall_s=1.0)
    decision = p.decision
    assert decision == (True, True)  # a probe towards verifying
    assert not p.may_verify()  # the next launch: plain, decided before the probe is read
    p.verified(1.0, 3.0, decision)
    assert p.probe_every == 2 * PROBE_EVERY
    p.verified(None, 3.0, (False, False))  # a launch with no live row teaches its time only
    assert p.probe_every == 2 * PROBE_EVERY and p.gain == pytest.approx(1.0) and len(p.round_times) == 6


def test_a_gain_just_above_the_cost_stays_plain():
    """The gain must beat the cost by MARGIN (10%): 1.6 tokens a round against rounds of 1.5 plain steps stays plain,
    1.7 verifies."""
    assert MARGIN == pytest.approx(1.1)
    for gain, verifies in ((1.6, False), (1.7, True)):
        p = policy()
        p.plain_times.extend([1.0] * 4)
        p.round_times.extend([1.5] * 4)
        p.gain = gain
        assert p.may_verify() == verifies


def test_plain_probes_back_off_while_verifying_still_pays_after_them():
    """Where verifying pays throughout, a probe towards plain (two plain launches, to time a step) comes after
    PROBE_EVERY verify launches, then twice as many each time the rule still verifies after it, up to MAX_PROBE_EVERY;
    a probe after which plain decoding wins brings the interval back, and the rule decodes plain on merit."""
    p = policy()
    p.plain_times.extend([1.0] * 4)
    p.round_times.extend([1.5] * 4)
    p.gain = 3.0  # 3 tokens a round against 1.5 plain steps: verifying pays
    at = run(p, 3000, tokens=3.0, round_s=1.5)
    plain = sorted(set(range(3000)) - set(at))
    assert all(b == a + 1 for a, b in zip(plain[::2], plain[1::2], strict=True))  # in pairs
    starts = plain[::2]
    runs = [b - a - 2 for a, b in zip([-2, *starts[:-1]], starts, strict=True)]  # verify launches before each pair
    expected = [min(PROBE_EVERY << i, MAX_PROBE_EVERY) for i in range(len(runs))]
    assert runs == expected and runs[-1] == MAX_PROBE_EVERY
    # Plain steps get cheap (0.2 s): the next probe's timed steps flip the rule, the interval starts again, and the
    # first probe towards verifying comes PROBE_EVERY plain launches later (counted from the flip).
    p.plain_times.clear()
    p.plain_times.extend([0.2] * 8)
    p.plain_probe_pending = True  # as after a probe: judged at the next free decision
    assert not p.may_verify() and p.plain_probe_every == PROBE_EVERY
    decisions = []
    for _ in range(PROBE_EVERY):
        decisions.append(p.may_verify())
        p.decoded(num_steps=1, wall_s=0.2)
    assert decisions == [False] * (PROBE_EVERY - 1) + [True] and p.probe_verify


def test_a_plain_probe_is_judged_by_the_step_it_timed():
    """After a probe towards plain, the interval doubles only if verifying still pays against the probe's own plain
    step: a cheaper step (0.4 s against rounds of 1 s: 2 tokens < 1.1 x 2.5) brings the interval back even while the
    median of the recent steps (still 1 s) keeps the rule verifying, so the next probes come soon."""
    for probe_s, interval in ((1.0, 128), (0.4, PROBE_EVERY)):
        p = policy()
        p.plain_times.extend([1.0] * 7)
        p.round_times.extend([1.0] * 4)
        p.gain, p.plain_probe_every, p.plain_probe_pending = 2.0, 64, True
        p.plain_times.append(probe_s)
        assert p.may_verify() and p.plain_probe_every == interval
