"""AllFailedGuard: a run stops after N steps in a row where every reward failed, naming the function and the first
error; one good sample resets the count."""

import pytest

from nonstop.rewards import AllFailedGuard, RewardResult

OK = RewardResult(1.0)


def failed(message: str, status: str = "error") -> RewardResult:
    return RewardResult(0.0, status=status, message=message)


def test_stops_after_the_limit_of_all_failed_steps_naming_function_and_first_error():
    guard = AllFailedGuard(limit=3, scorer="my_reward.py:compute_score")
    guard.check(1, [failed("KeyError: 'answer'"), failed("KeyError: 'answer'")])
    guard.check(2, [failed("KeyError: 'answer'", "timeout")])
    with pytest.raises(RuntimeError) as e:
        guard.check(3, [failed("TypeError: first"), failed("ValueError: second", "timeout")])
    message = str(e.value)
    assert message.startswith("step 3: every reward failed in 3 steps in a row (2 samples this step, 1 of them")
    assert "reward_model.max_all_failed_steps=3" in message
    assert "my_reward.py:compute_score" in message and message.endswith("First error: TypeError: first")


def test_one_scored_sample_resets_the_streak_and_zero_never_stops():
    guard = AllFailedGuard(limit=2, scorer="f")
    guard.check(1, [failed("x")])
    guard.check(2, [failed("x"), OK])  # not every reward failed
    assert guard.streak == 0
    guard.check(3, [failed("x")])
    guard.check(4, [])  # nothing scored (e.g. a reward model replaced the rules): no evidence either way
    assert guard.streak == 0
    never = AllFailedGuard(limit=0, scorer="f")
    for step in range(1, 50):
        never.check(step, [failed("x")])
    assert never.streak == 49
