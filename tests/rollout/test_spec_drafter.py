"""The suffix drafter (longest match over the group's text, drafts by vote, earlier responses kept per prompt) and the
rule that decides when drafting pays, on hand-built token streams and hand-computed decisions."""

import pytest

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout import SamplingParams
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.history import ResponseHistory
from nonstop.rollout.spec.policy import DECAY, MAX_PROBE_EVERY, PROBE_EVERY, DraftPolicy
from nonstop.rollout.spec.suffix import SuffixDrafter

PROMPT = [1, 2, 3, 4, 5]


def group(*outputs: list[int], request_id: str = "r", prompt=PROMPT) -> list[Sequence]:
    seqs = []
    for i, output in enumerate(outputs):
        seq = Sequence(request_id, prompt, SamplingParams(n=len(outputs)), seed=0, sample_index=i)
        seq.token_ids += output
        seq.output_logprobs += [0.0] * len(output)
        seqs.append(seq)
    return seqs


def drafter(min_match=1, min_prob=0.0, history=8) -> SuffixDrafter:
    return SuffixDrafter(max_match=16, min_match=min_match, min_token_prob=min_prob, max_cached_prompts=history)


def draft(d: SuffixDrafter, seqs: list[Sequence], i: int, k: int = 8) -> list[int]:
    return d.propose([seqs[i]], [seqs], [k])[0]


def test_a_sibling_ahead_is_copied_from_the_longest_match():
    seqs = group([6, 7, 8, 9], [6, 7])
    assert draft(drafter(), seqs, 1) == [8, 9]
    assert draft(drafter(), seqs, 1, k=1) == [8]


def test_the_prompt_and_the_sequences_own_earlier_text_are_drafted_from():
    assert draft(drafter(), group([9, 2, 3]), 0) == [4, 5]  # "2 3" continues as in the prompt
    assert draft(drafter(), group([7, 8, 9, 4, 7, 8]), 0) == [9, 4, 7, 8]  # its own "7 8" ran on with "9 4 ..."


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # Query ends "... 3 8 7"; sibling 0 matches "3 8 7" (then 1), sibling 1 only "8 7" (then 2).
    seqs = group([3, 8, 7, 1], [9, 8, 7, 2], [3, 8, 7])
    assert draft(drafter(), seqs, 2, k=1) == [1]


def test_drafts_are_voted_and_end_where_the_candidates_stop_agreeing():
    # Three siblings continue "6 7" as 8 9 | 8 10 | 11: 8 (2 of 3), then 9 or 10 (1 of 2: the most recent, 10).
    seqs = group([6, 7, 8, 9], [6, 7, 8, 10], [6, 7, 11], [6, 7])
    assert draft(drafter(min_prob=0.0), seqs, 3) == [8, 10]
    assert draft(drafter(min_prob=0.5), seqs, 3) == [8]  # 2/3 * 1/2 < 0.5
    assert draft(drafter(min_prob=0.7), seqs, 3) == []  # 2/3 < 0.7


def test_no_match_as_long_as_min_match_drafts_nothing():
    seqs = group([6, 7, 8, 9], [0, 7])  # only "7" matches
    assert draft(drafter(min_match=2), seqs, 1) == []
    assert draft(drafter(min_match=1), seqs, 1) == [8, 9]


def test_siblings_in_lock_step_have_nothing_ahead_until_one_is():
    d = drafter()
    seqs = group([6], [6])
    assert draft(d, seqs, 0) == []  # nothing follows either sample's "5 6" yet
    seqs[1].token_ids += [7, 8]
    assert draft(d, seqs, 0) == [7, 8]  # the same index, synced with the sibling's new tokens


def test_indexing_ahead_skips_placeholders_keeps_its_budget_and_drafts_as_without_it():
    """`prepare` (called while the device runs a plain step) indexes only the tokens the host has, never the
    placeholders of the step in flight, at most `max_tokens` a call; drafts after it equal a drafter's that never
    prepared, whatever it left unindexed."""
    outputs = ([6, 7, 8, 9, 6, 7], [6, 7, 8, 3, 6, 7], [6, 2, 2])
    ahead, fresh = drafter(), drafter()
    seqs, twins = group(*outputs), group(*outputs)
    for seq in seqs:
        seq.token_ids += [-1 - seq.sample_index, -4 - seq.sample_index]  # two steps in flight
    before = ahead.groups.get("r")
    assert before is None
    ahead.prepare(seqs, [seqs] * 3, max_tokens=len(PROMPT) + 7)  # the prompt stream, then 7 of 15 known tokens
    index, streams = ahead.groups["r"]
    indexed = sum(index.indexed[streams[s.seq_id]] - (len(PROMPT) - 1) for s in seqs)
    assert indexed == 7
    keys = [k for table in (index.by1, index.by2, index.by3) for k in table]
    assert all(k >= 0 for k in keys) and not any(t < 0 for t in index.by1)
    ahead.prepare(seqs, [seqs] * 3, max_tokens=100)
    assert [index.indexed[streams[s.seq_id]] for s in seqs] == [len(s.token_ids) - 2 for s in seqs]
    for seq in seqs:  # the step in flight lands: the same tokens as the twins'
        del seq.token_ids[-2:]
    for i in range(3):
        assert draft(ahead, seqs, i) == draft(fresh, twins, i)
    assert [draft(ahead, seqs, i) for i in range(3)] != [[]] * 3  # something to compare


def test_indexing_ahead_charges_a_new_groups_prompt_and_history():
    """A group met for the first time indexes its prompt and its history's streams whole; that counts against the
    budget, so a call whose budget the first group's history used up creates no second group and indexes no sample."""
    d = drafter()
    d.history.put(PROMPT, [[6, 7, 8, 9], [6, 2]])  # streams of 5 + 4 and 5 + 2 tokens
    first, second = group([6, 7], [6, 3], request_id="a"), group([9, 9], request_id="b", prompt=[5, 4, 3])
    d.prepare(first + second, [first, first, second], max_tokens=len(PROMPT) + 16)  # prompt 5 + history 16
    index, streams = d.groups["a"]
    assert [index.indexed[streams[s.seq_id]] for s in first] == [len(PROMPT) - 1] * 2  # no sample token yet
    assert "b" not in d.groups
    d.prepare(first + second, [first, first, second], max_tokens=100)
    assert [index.indexed[streams[s.seq_id]] for s in first] == [len(PROMPT) + 2] * 2 and "b" in d.groups


def test_a_finished_requests_responses_draft_for_the_next_one_with_its_prompt():
    d = drafter()
    first = group([6, 7, 8], [6, 9, 9], request_id="a")
    d.propose(first, [first, first], [4, 4])
    d.finished("a", PROMPT, [s.output_token_ids for s in first])
    assert "a" not in d.groups
    again = group([6], request_id="b")
    assert draft(d, again, 0) in ([7, 8], [9, 9])
    other = group([6], request_id="c", prompt=[5, 4, 3])
    assert draft(d, other, 0) == []  # another prompt has no history


def test_history_keeps_the_most_recently_used_prompts():
    history = ResponseHistory(max_prompts=2)
    history.put([1], [[10]])
    history.put([2], [[20]])
    assert history.get([1]) == [[10]]  # used: [2] is now the oldest
    history.put([3], [[30]])
    assert history.get([2]) == [] and history.get([1]) == [[10]] and history.get([3]) == [[30]]
    history.put([1], [[11], [12]])  # a later request replaces the responses
    assert history.get([1]) == [[11], [12]] and len(history) == 2
    assert len(ResponseHistory(max_prompts=0)) == 0


def policy(rule="auto", max_draft=4) -> DraftPolicy:
    return DraftPolicy(SpeculativeConfig(method="suffix", draft_rule=rule, num_speculative_tokens=max_draft))


def test_always_verifies_every_draft_at_full_length():
    p = policy("always")
    assert p.draft_lengths([7]) == [4] and p.should_verify([7, 8], [0, 1]) and not p.should_verify([7, 8], [0, 0])


def test_auto_verifies_while_the_expected_tokens_beat_the_measured_cost():
    p = policy()
    assert p.cost_ratio() is None and p.should_verify([1, 2], [4, 4])  # nothing measured: try it
    for _ in range(4):
        p.decoded(num_steps=8, wall_s=8.0)  # 1 s per plain step
        p.verified([1, 2], [4, 4], [1, 1], wall_s=1.5)
    assert p.cost_ratio() == pytest.approx(1.5)
    # g moved from 1 towards 1 (1 accepted of 4): exactly 1 + 1 = 2 >= 1.5 verifies.
    assert p.gain[1] == pytest.approx(1.0) and p.should_verify([1, 2], [4, 4])
    p.gain[1] = p.gain[2] = 0.4  # 1.4 < 1.5
    assert not p.should_verify([1, 2], [4, 4])
    # Only sequences with a draft count: one at 1.0 and one without a draft expect 1 + 0.5.
    p.gain[1] = 1.0
    assert p.should_verify([1, 2], [4, 0]) and p.expected_gain([1, 2], [4, 0]) == pytest.approx(0.5)


def test_a_verify_step_that_captured_a_graph_teaches_acceptance_but_not_cost():
    """The engine passes no time for a launch that captured its CUDA graph: the capture must not make verifying look
    dear, but the accepted tokens still count."""
    p = policy()
    p.decoded(num_steps=8, wall_s=8.0)
    p.verified([1], [4], [4], wall_s=None)
    assert p.cost_ratio() is None and p.gain[1] == pytest.approx(1.0 + DECAY * 3) and p.draft_lengths([1]) == [4]
    p.verified([1], [4], [2], wall_s=1.5)
    assert p.cost_ratio() == pytest.approx(1.5)


def test_auto_probes_the_other_way_less_often_while_probes_do_not_pay():
    """Where verifying never pays, a probe verifies after PROBE_EVERY plain steps, then after twice as many each time
    (each probe cost the run a verify step that lost), up to MAX_PROBE_EVERY; a probe that pays brings the interval
    back to PROBE_EVERY."""
    p = policy()
    p.plain_times.extend([1.0] * 4)
    p.verify_times.extend([10.0] * 4)  # verifying never pays

    def run(steps: int, accepted: int, verify_s: float) -> list[int]:
        verified_at = []
        for i in range(steps):
            if p.may_verify([1]) and p.should_verify([1], [4]):
                verified_at.append(i)
                p.verified([1], [4], [accepted], wall_s=verify_s)
            else:
                p.decoded(num_steps=1, wall_s=1.0)
        return verified_at

    at = run(4000, accepted=0, verify_s=10.0)
    gaps = [b - a - 1 for a, b in zip([-1, *at[:-1]], at, strict=True)]  # plain steps before each probe
    expected = [min(PROBE_EVERY << i, MAX_PROBE_EVERY) for i in range(len(gaps))]
    assert gaps == expected and gaps[-1] == MAX_PROBE_EVERY and len(at) <= 4000 / PROBE_EVERY / 8
    # Verify steps get cheap (2 plain steps) and drafts fully accepted: the next probe pays (1 + 4 >= 2), the interval
    # is PROBE_EVERY again and the rule verifies on merit from then on.
    p.verify_times.extend([2.0] * 8)
    at = run(MAX_PROBE_EVERY + 1, accepted=4, verify_s=2.0)
    assert p.probe_every == PROBE_EVERY and len(at) > MAX_PROBE_EVERY / 2


def test_a_step_that_verifies_on_merit_brings_the_probe_interval_back():
    """Once the rule verifies on its own say, probes go towards plain (to keep plain times current): they come every
    PROBE_EVERY steps again, not at the interval losing probes had backed off to."""
    p = policy()
    p.plain_times.extend([1.0] * 4)
    p.verify_times.extend([2.0] * 4)
    p.probe_every = MAX_PROBE_EVERY  # backed off
    p.global_gain = 3.0  # 1 + 3 >= 2: verifying pays
    assert p.may_verify([1]) and not p.probing and p.should_verify([1], [4])
    p.verified([1], [4], [3], wall_s=2.0)
    assert p.probe_every == PROBE_EVERY


def test_a_step_with_drafts_verifies_while_no_verify_step_was_timed():
    """A warm-up whose verify launches all captured CUDA graphs leaves no verify time, and its rejections can pull every
    gain to nothing: the rule must still ask and verify (whatever the gains) until a verify step is timed."""
    p = policy()
    p.decoded(num_steps=8, wall_s=8.0)
    for _ in range(8):
        p.verified([1], [4], [0], wall_s=None)  # captured: acceptance learnt, no cost
    assert p.global_gain < 0.1 and p.cost_ratio() is None and p.draft_lengths([2]) == [4]
    assert p.may_verify([2]) and p.should_verify([2], p.draft_lengths([2]))
    p.verified([2], [4], [3], wall_s=1.0)
    # Measured as dear as a plain step with 3 tokens accepted: the next step verifies on merit.
    assert p.cost_ratio() == pytest.approx(1.0) and p.may_verify([2]) and p.should_verify([2], [4])


def test_every_sequence_drafts_in_a_verify_step_whatever_its_gain():
    """In the drafting range a step costs about the same at any number of tokens, so a sequence whose drafts were all
    rejected drafts again (at its adapted length): left out, it could not shorten the generation if it is the one that
    ends last. Where verifying does not pay, only the probe verifies, with every sequence drafting, and reading the step
    in flight between asking and drafting does not undo it."""
    p = policy()
    p.plain_times.extend([1.0] * 4)
    p.verify_times.extend([3.0] * 4)
    p.global_gain = 0.03
    p.gain[1], p.cap[1] = 0.0, 2
    decisions = []
    for _ in range(PROBE_EVERY + 1):
        asked = p.may_verify([1, 2])
        lengths = p.draft_lengths([1, 2])
        p.decoded(num_steps=1, wall_s=1.0)  # the engine reads the step in flight between asking and drafting
        verify = asked and p.should_verify([1, 2], lengths)
        decisions.append((verify, lengths))
        if verify:
            p.verified([1, 2], lengths, [0, 0], wall_s=3.0)
    assert decisions[:-1] == [(False, [2, 4])] * PROBE_EVERY and decisions[-1] == (True, [2, 4])


def test_asks_that_find_nothing_to_verify_make_the_rule_ask_less():
    """An ask reads the step in flight (about one plain step of pipelining, DRAIN_COST). With verify at 1.5 plain
    steps and 1 + g = 2 expected, an ask pays 0.5 when it verifies: worth it while the yield y of recent asks keeps
    y * 0.5 >= (1 - y) * 1, i.e. y >= 2/3. Asks that find no draft pull y below that; then only a probe asks, and
    asks that verify raise y again."""
    p = policy()
    p.plain_times.extend([1.0] * 4)
    p.verify_times.extend([1.5] * 4)
    p.global_gain = 1.0
    assert p.may_verify([1]) and p.ask_yield == 1.0
    outcomes = []
    for _ in range(10):
        if p.may_verify([1]):
            p.asked(p.should_verify([1], [0]))  # the drafter found nothing
            outcomes.append("asked")
        else:
            p.decoded(num_steps=1, wall_s=1.0)
            outcomes.append("plain")
    # y: 1, 0.8, 0.64 < 2/3 after two fruitless asks.
    assert outcomes == ["asked", "asked"] + ["plain"] * 8 and p.ask_yield == pytest.approx(0.64)
    while not p.may_verify([1]):  # until the probe
        pass
    assert p.probe_verify and p.should_verify([1], [4])
    for _ in range(3):
        p.asked(True)
    assert p.ask_yield > 2 / 3 and p.may_verify([1])


def test_the_rule_learns_plain_steps_while_it_verifies():
    """In the engine a plain step's time is learnt only when the next step does not ask for drafts (an ask reads the
    step in flight with nothing behind it). Here a draft always exists, 1 of 4 tokens is accepted and a verify step
    costs 3 plain steps, so verifying loses (1 + 1 < 3): the rule must time plain steps first, then settle on plain."""
    p = policy()
    previous_plain = False
    decisions = []
    for _ in range(200):
        asked = p.may_verify([1, 2])
        if previous_plain and not asked:
            p.decoded(num_steps=1, wall_s=1.0)  # read behind this step's launch
        verify = asked and p.should_verify([1, 2], p.draft_lengths([1, 2]))
        if asked:
            p.asked(verify)
        if verify:
            p.verified([1, 2], [4, 4], [1, 1], wall_s=3.0)
        decisions.append(verify)
        previous_plain = not verify
    assert p.cost_ratio() == pytest.approx(3.0)
    assert decisions[:2] == [False, False]  # plain timed before any ask
    assert sum(decisions[100:]) <= 100 / PROBE_EVERY + 1  # probes only


def test_draft_lengths_follow_each_sequences_outcomes():
    p = policy(max_draft=8)
    p.verified([1, 2, 3], [4, 4, 4], [4, 3, 0], wall_s=1.0)
    assert p.draft_lengths([1, 2, 3]) == [6, 4, 4]  # all kept: +2; rejected at 3: 3 + 1; at 0: never under half (4)
    assert p.gain[3] == pytest.approx(1.0 - DECAY)
    p.verified([1, 2], [6, 4], [6, 4], wall_s=1.0)
    p.verified([1, 2], [8, 6], [8, 1], wall_s=1.0)
    assert p.draft_lengths([1, 2]) == [8, 4]  # grown to the most; rejected at 1, held at the half
    for _ in range(5):
        p.verified([3], [4], [0], wall_s=1.0)
    assert p.draft_lengths([3]) == [4]  # still drafts: its tokens cost nothing in a verify step
    p.forget([1, 2, 3])
    assert not p.gain and not p.cap
    assert p.draft_lengths([1]) == [8]  # a new sequence starts at the most


def test_the_offline_replay_counts_what_verify_steps_keep():
    """One sample repeating "4 5": the first two steps find nothing earlier to draft from (plain steps), then its own
    "4" drafts "5 4" (both kept, plus the verify step's "5"), then "5 4 5" drafts "4" (kept, plus "5": the end)."""
    from nonstop.rollout.spec.replay import replay

    config = SpeculativeConfig(method="suffix", draft_rule="always", prompt_lookup_min=1)
    stats = replay([([1, 2, 3], [[4, 5, 4, 5, 4, 5, 4, 5]])], config)
    assert (stats.steps, stats.plain_steps, stats.verify_steps, stats.range_plain_steps) == (4, 7, 2, 2)
    assert (stats.verify_seqs, stats.drafted, stats.accepted, stats.verify_tokens) == (2, 3, 3, 5)
    assert stats.tokens_per_verify == 2.5 and stats.speedup(1.0) == 7 / 4 and stats.speedup(2.0) == 7 / 6
