"""The carry-over does not bias which response lengths are trained (`actor_rollout_ref.rollout.tail.*`): on planted
long-tailed lengths, the lengths a carry-over run trains over its steps have the distribution plain `sync` trains,
by a two-sample Kolmogorov–Smirnov test at significance 0.01; the same test rejects an over-provisioned
shortest-first selection (APRIL without the carry-over's admission order: admit twice the prompts, train the
shortest groups) computed on the same prompts.

The tiny model has no EOS, so a response runs to its prompt's `max_tokens`: a log-normal draw seeded by the prompt's
tokens (median 3, the bench's `longtail` shape scaled to the 8-token cap). All n samples of a group share it, so the
group is the unit: the test counts groups, not samples (the empirical distributions are the same either way). The
last step is left out of both: it finishes every carried sequence, so over the whole run the two train the same
samples by construction."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from test_async_trainer import _record_batches
from test_carry import CARRY
from trainer_helpers import FixedPrompts

STEPS, BATCH = 16, 4
ALPHA = 0.01


def planted_length(prompt_ids: list[int]) -> int:
    draw = np.random.default_rng(list(prompt_ids)).lognormal(math.log(3.0), 0.8)
    return int(min(8, max(1, round(draw))))


def planted(trainer):
    trainer.request_params = lambda prompt, params: replace(params, max_tokens=planted_length(prompt.prompt_token_ids))
    return trainer


def ks_statistic(a: list[int], b: list[int]) -> float:
    """The two-sample Kolmogorov–Smirnov statistic: the largest gap between the two empirical CDFs."""
    return max(abs(sum(x <= v for x in a) / len(a) - sum(x <= v for x in b) / len(b)) for v in set(a) | set(b))


def ks_critical(n: int, m: int, alpha: float = ALPHA) -> float:
    """The asymptotic critical value of the statistic at significance `alpha` (conservative for tied values)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def group_lengths(batches) -> list[int]:
    """Each trained group's response length (its samples share it), over the given steps' batches."""
    return [
        length for batch in batches for length in {s.uid: len(s.response_token_ids) for s in batch.samples}.values()
    ]


def shortest_first(steps: int, batch_size: int) -> list[int]:
    """The biased selection on the same prompts: each step admits 2·batch_size prompts and trains the batch_size
    shortest groups waiting (the rest wait, and keep waiting while shorter ones arrive)."""
    loader, waiting, trained = FixedPrompts(batch_size), [], []
    for _ in range(steps):
        waiting += [planted_length(p.prompt_token_ids) for _ in range(2) for p in loader.next_batch()]
        waiting.sort()
        trained += waiting[:batch_size]
        waiting = waiting[batch_size:]
    return trained


def test_ks_statistic_by_hand():
    assert ks_statistic([1, 2, 3], [2, 3, 4]) == pytest.approx(1 / 3)
    assert ks_statistic([1, 1], [2, 2]) == 1.0 and ks_statistic([5, 1], [1, 5]) == 0.0
    assert ks_critical(60, 60) == pytest.approx(1.6276 * math.sqrt(2 / 60), rel=1e-4)


def test_trained_lengths_match_sync_and_a_shortest_first_selection_does_not(trainer_factory):
    steps = (f"trainer.total_training_steps={STEPS}",)
    sync = planted(trainer_factory(steps))
    sync_batches = _record_batches(sync)
    sync.fit()
    carry = planted(trainer_factory((*steps, *CARRY)))
    carry_batches = _record_batches(carry)
    history = carry.fit()
    assert sum(m["tail/num_carried"] for m in history[:-1]) >= STEPS  # the tail was cut in most steps

    reference = group_lengths(sync_batches[:-1])
    assert len(reference) == (STEPS - 1) * BATCH and max(reference) >= 3 * min(reference)  # long-tailed
    carried = group_lengths(carry_batches[:-1])
    critical = ks_critical(len(reference), len(carried))
    assert ks_statistic(reference, carried) < critical, (sorted(reference), sorted(carried))
    biased = shortest_first(STEPS - 1, BATCH)
    assert ks_statistic(reference, biased) > critical, (sorted(reference), sorted(biased))
