"""The device drafter (longest suffix match over the group's streams and the other groups',
rollout/spec/suffix_match.py) against a plain Python reference and hand-built cases, the draft streams kept on the
device, earlier responses kept per prompt, and the offline replay."""

import dataclasses
import random

import pytest
import torch

from nonstop.config.rollout import SpeculativeConfig
from nonstop.rollout import SamplingParams
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.spec.history import ResponseHistory
from nonstop.rollout.spec.streams import DraftStreams
from nonstop.rollout.spec.suffix_match import suffix_match_drafts

P = [1, 2, 3, 4, 5]


def draft(streams: list[list[int]], mates: list[int] = (), D: int = 4, max_match: int = 16, min_match: int = 1,
          group: int | None = None):  # fmt: skip
    """The draft of a row whose own stream is streams[0], drafting from itself and `mates`, the first `group` of the
    listed streams (default: all) its group's."""
    L = max(map(len, streams)) + 2
    tokens_SL = torch.zeros(len(streams), L, dtype=torch.int32)
    for s, t in enumerate(streams):
        tokens_SL[s, : len(t)] = torch.tensor(t)
    lengths_S = torch.tensor([len(t) for t in streams])
    streams_NG = torch.tensor([[0, *mates]])
    group_N = torch.tensor([1 + len(mates) if group is None else group])
    drafts_ND, draft_len_N = suffix_match_drafts(tokens_SL, lengths_S, torch.tensor([0]), streams_NG, group_N, D,
                                                 max_match, min_match)  # fmt: skip
    return drafts_ND[0][: draft_len_N[0]].tolist()


def test_a_sibling_ahead_is_copied_from_the_longest_match():
    assert draft([P + [6, 7], P + [6, 7, 8, 9, 10]], [1]) == [8, 9, 10]  # only three tokens follow
    assert draft([P + [6, 7], P + [6, 7, 8, 9, 10, 11, 12]], [1], D=4) == [8, 9, 10, 11]


def test_the_prompt_and_the_rows_own_earlier_text_are_drafted_from():
    assert draft([P + [9, 2, 3]]) == [4, 5, 9, 2]  # "2 3" in the prompt, followed by the row's own text
    assert draft([[7, 8, 9, 7, 8]]) == [9, 7, 8]  # its own repetition


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # "1 6 7" matches three tokens early in the sibling; "6 7" only two, later, in the row's own text.
    own = P + [9, 6, 7, 1, 6, 7]
    assert draft([own, [1, 6, 7, 8, 8]], [1]) == [8, 8]
    # max_match 2 cuts both to two tokens: the later one, with as long a continuation, wins.
    assert draft([own, [1, 6, 7, 8, 8]], [1], D=2, max_match=2) == [1, 6]


def test_a_longer_continuation_wins_between_equal_matches_then_the_later_position():
    own = P + [6, 7]
    short, long = P + [0, 6, 7, 8], P + [6, 7, 9, 9, 9]
    assert draft([own, short, long], [1, 2]) == [9, 9, 9]
    assert draft([own, long, short], [1, 2]) == [9, 9, 9]
    # Equal matches and continuations: the later position.
    assert draft([own, [0, 0, 0, 6, 7, 3, 3], [0, 6, 7, 4, 4, 1]], [1, 2], D=2) == [3, 3]


def test_at_equal_matches_the_rows_own_text_wins_then_its_groups_then_another_groups():
    own = [5, 0, 6, 7]
    sibling, other = [6, 7, 4, 4, 4], [1, 1, 6, 7, 2, 2]  # "6 7" at positions 1 and 3
    # The other group's match is later: it wins only as the sibling's equal (all three listed as the group's).
    assert draft([own, sibling, other], [1, 2], D=2, group=3) == [2, 2]
    assert draft([own, sibling, other], [1, 2], D=2, group=2) == [4, 4]
    # The row's own earlier "6 7" beats both, though it is earlier than either.
    assert draft([[6, 7, 8, 8, 0, 6, 7], [1, 1, 1, 6, 7, 4, 4], other], [1, 2], D=2, group=2) == [8, 8]
    # A longer match in another group wins over a shorter one in the row's own group.
    assert draft([[9, 6, 7], sibling, [9, 6, 7, 3, 3]], [1, 2], D=2, group=2) == [3, 3]


def test_no_match_as_long_as_min_match_drafts_nothing():
    assert draft([[9, 8, 5], [5, 6, 7]], [1], min_match=2) == []
    assert draft([[9, 8, 5], [5, 6, 7]], [1], min_match=1) == [6, 7]


def test_siblings_in_lock_step_have_nothing_ahead_and_absent_streams_count_for_nothing():
    assert draft([P + [6, 7], P + [6, 7]], [1]) == []
    assert draft([P + [6, 7], P + [6, 7, 8]], [-1, 1, -1]) == [8]


def reference_draft(streams, lengths, own, mates, group, D, max_match, min_match):
    """Per candidate (stream, position): (match length, the stream's tier: 2 the row's own, 1 among the first `group`
    listed, 0 another group's; known tokens after it up to D, position), the best by that order (the first stream
    among equals); its continuation if the match is long enough."""
    x = streams[own][: lengths[own]]
    best = None
    for g, s in enumerate(mates):
        if s < 0:
            continue
        tokens = streams[s][: lengths[s]]
        for p in range(len(tokens)):
            follows = min(len(tokens) - 1 - p, D)
            if follows <= 0:
                continue
            m = 0
            while m < max_match and m <= p and m < len(x) and tokens[p - m] == x[-1 - m]:
                m += 1
            key = (m, (s == own) + (g < group), follows, p, -g)
            if best is None or key > best[0]:
                best = (key, tokens[p + 1 : p + 1 + follows])
    if best is None or best[0][0] < min_match:
        return []
    return best[1]


@pytest.mark.parametrize("seed", range(6))
def test_drafts_equal_a_plain_python_reference_on_random_streams(seed):
    rng = random.Random(seed)
    D, max_match, min_match = rng.choice([2, 4, 8]), rng.choice([1, 3, 16]), rng.choice([1, 2])
    S, L = 7, 40
    streams = [[rng.randrange(4) for _ in range(L)] for _ in range(S)]  # 4 token ids: many matches
    lengths = [rng.randrange(1, L + 1) for _ in range(S)]
    own = list(range(4))
    mates = [[n] + rng.sample([s for s in range(S) if s != n], 3) + [-1] for n in own]
    groups = [rng.randrange(1, 6) for _ in own]
    tokens_SL = torch.tensor(streams, dtype=torch.int32)
    drafts_ND, draft_len_N = suffix_match_drafts(tokens_SL, torch.tensor(lengths), torch.tensor(own),
                                                 torch.tensor(mates), torch.tensor(groups), D, max_match,
                                                 min_match)  # fmt: skip
    for n in own:
        expected = reference_draft(streams, lengths, n, mates[n], groups[n], D, max_match, min_match)
        assert drafts_ND[n][: draft_len_N[n]].tolist() == expected
        assert (drafts_ND[n][draft_len_N[n] :] == 0).all()


def seq(request_id: str, output: list[int], sample_index: int = 0, prompt=P) -> Sequence:
    s = Sequence(request_id, prompt, SamplingParams(n=2), seed=0, sample_index=sample_index)
    s.token_ids += output
    s.output_logprobs += [0.0] * len(output)
    return s


def table(streams: DraftStreams, slot: int) -> list[int]:
    return streams.tokens_SL[slot, : streams.held[slot]].tolist()


def test_draft_streams_upload_what_the_device_lacks_and_free_a_finished_requests_slots():
    history = ResponseHistory(max_prompts=4)
    history.put(P, [[40, 41]])
    streams = DraftStreams(num_slots=6, capacity=16, device=torch.device("cpu"), history=history)
    a0, a1 = seq("a", [6, 7]), seq("a", [6], sample_index=1)
    own, mates, group, lengths, longest = streams.plan([a0], lambda s: [a0, a1], num_streams=4)
    streams.upload()
    slot0, slot1 = own[0], mates[0][1]
    assert mates[0][0] == slot0 and mates[0][3] == -1 and group[0] == 3 and longest == len(P) + 2
    assert table(streams, slot0) == P + [6, 7] and table(streams, slot1) == P + [6]
    assert table(streams, mates[0][2]) == P + [40, 41]  # the prompt's earlier response
    assert lengths[slot0] == len(P) + 2
    # The rounds appended 8 9 on the device (here by hand); the host appends the same and marks it held.
    streams.tokens_SL[slot0, len(P) + 2 : len(P) + 4] = torch.tensor([8, 9])
    a0.token_ids += [8, 9]
    streams.kept([a0])
    # A plain step decoded 3 for the sibling: only that token is uploaded.
    a1.token_ids += [3]
    streams.plan([a0, a1], lambda s: [a0, a1], num_streams=4)
    assert streams._uploads == [(slot1 * 16 + len(P) + 1, [3])]
    streams.upload()
    assert table(streams, slot1) == P + [6, 3] and table(streams, slot0) == P + [6, 7, 8, 9]
    streams.release("a")
    assert len(streams.free) == 6 and "a" not in streams.members


@pytest.mark.parametrize("across", [True, False])
def test_rows_list_the_other_groups_samples_after_their_own_groups_streams(across):
    history = ResponseHistory(max_prompts=4)
    history.put(P, [[40, 41]])
    streams = DraftStreams(num_slots=8, capacity=16, device=torch.device("cpu"), history=history, across_groups=across)
    a0, a1 = seq("a", [6, 7]), seq("a", [6], sample_index=1)
    b0, b1 = seq("b", [8], prompt=[9, 9]), seq("b", [8, 8, 8], sample_index=1, prompt=[9, 9])
    members = {"a": [a0, a1], "b": [b0, b1]}
    own, mates, group, _, longest = streams.plan([a0, b1], lambda s: members[s.request_id], num_streams=5)
    slot = {s.seq_id: streams.members[s.request_id][s.seq_id] for s in (a0, a1, b0, b1)}
    past = streams.past["a"][0][0]
    assert group.tolist() == [3, 2]  # a: its own, its sibling, the prompt's earlier response; b: its samples
    if across:  # then the other group's samples, in sample order, as far as num_streams reaches
        assert mates.tolist() == [
            [slot[a0.seq_id], slot[a1.seq_id], past, slot[b0.seq_id], slot[b1.seq_id]],
            [slot[b1.seq_id], slot[b0.seq_id], slot[a0.seq_id], slot[a1.seq_id], -1],
        ]
    else:
        assert mates.tolist() == [
            [slot[a0.seq_id], slot[a1.seq_id], past, -1, -1],
            [slot[b1.seq_id], slot[b0.seq_id], -1, -1, -1],
        ]
    assert own.tolist() == [slot[a0.seq_id], slot[b1.seq_id]]
    assert longest == len(P) + 2  # P + [6, 7] or P + [40, 41]: the longest stream a row lists


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


def test_the_offline_replay_counts_what_verify_rounds_keep():
    """One sample repeating "4 5" after the prefill's "4": rounds 1-2 find nothing earlier to draft from (one token
    each: 5, 4); round 3's "4" drafts "5 4" (the two known after the first "4"; both kept, plus the round's 5); round
    4's "4 5 4 5" (matched four deep) drafts "4 5", both right, but only two tokens remain: kept 4 5, one draft token
    counted as kept, the last as the round's own."""
    from nonstop.rollout.spec.replay import replay

    config = SpeculativeConfig(method="suffix", prompt_lookup_min=1, num_speculative_tokens=4)
    stats = replay([([1, 2, 3], [[4, 5, 4, 5, 4, 5, 4, 5]])], config)
    assert (stats.steps, stats.plain_steps, stats.verify_steps) == (4, 7, 4)
    assert (stats.verify_seqs, stats.drafted, stats.accepted, stats.verify_tokens) == (4, 4, 3, 7)
    assert stats.tokens_per_verify == 7 / 4 and stats.speedup(1.0) == 7 / 4 and stats.speedup(2.0) == 7 / 8
    # Priced by tokens: plain, 7 steps of one row; with speculation, 4 rounds of one row x 5 query slots (the budget
    # leaves the row its 4 draft tokens). At 0.1 a token: (7 + 0.7) / (4 + 2.0).
    assert (stats.plain_tokens, stats.query_tokens, stats.plain_row_steps) == (7, 20, 0)
    assert stats.token_speedup(0.0) == 7 / 4 and abs(stats.token_speedup(0.1) - 7.7 / 6.0) < 1e-12


def test_the_offline_replay_bounds_what_verify_rounds_may_cost():
    """The first replay's case (7 plain steps of one row, 4 rounds of one row): with every round priced as a plain
    step of its row, at 0.1 a token, (7 + 0.7) / (4 + 0.4) = 1.75x is the ceiling; 1.5x leaves a round 7.7 / 1.5 /
    4.4 = 7/6 of a plain step. In the two-row case every round after the first has one row left, and the plain
    generation took 3 steps too: free rounds only match it (3.4 / 3.4), so 1.5x needs rounds cheaper than plain
    steps."""
    from nonstop.rollout.spec.replay import replay

    config = SpeculativeConfig(method="suffix", prompt_lookup_min=1, num_speculative_tokens=4)
    stats = replay([([1, 2, 3], [[4, 5, 4, 5, 4, 5, 4, 5]])], config)
    assert abs(stats.free_speedup(0.1) - 7.7 / 4.4) < 1e-12
    assert abs(stats.break_even_round(1.5, 0.1) - 7 / 6) < 1e-12
    assert abs(stats.break_even_round(stats.free_speedup(0.1), 0.1) - 1.0) < 1e-12
    two = replay([([1, 2, 3], [[4, 5, 4, 5], [6, 7]])], config)
    assert abs(two.free_speedup(0.1) - 1.0) < 1e-12 and abs(two.break_even_round(1.5, 0.1) - 2 / 3) < 1e-12
    assert replay([([1, 2], [[3]])], config).break_even_round(1.5, 0.1) == 0.0  # nothing verified
    # With a drafting range of one sequence the first step, both rows live, is a plain step of 2 rows (the second
    # sample ends there); 3 rounds of one row follow (4; 5 4 drafted and kept, plus 5; 4 5). Plain: 7 + 0.8. Rounds
    # at a plain step's price: 1 + 0.2 outside them, 3 + 0.3 for them: 7.8 / 4.5; for 1.5x the rounds may cost
    # (7.8 / 1.5 - 1.2) / 3.3 plain steps (5.2 / 3.3 if the plain step outside them were left out).
    ranged = dataclasses.replace(config, disable_by_batch_size=1)
    three = replay([([1, 2, 3], [[4, 5, 4, 5, 4, 5, 4, 5], [6, 7]])], ranged)
    assert (three.steps, three.verify_steps, three.plain_row_steps, three.plain_tokens) == (4, 3, 2, 8)
    assert abs(three.free_speedup(0.1) - 7.8 / 4.5) < 1e-12
    assert abs(three.break_even_round(1.5, 0.1) - 4.0 / 3.3) < 1e-12


def test_the_offline_replay_drafts_within_the_token_budget():
    """The same sample with a budget of 2 tokens a round: one row drafts one token. Rounds 1-2 draft nothing (5, 4);
    rounds 3 and 4 draft "5" after the latest "4", kept with the round's 4; round 5 drafts "5", the last token, kept as
    the round's own."""
    from nonstop.rollout.spec.replay import replay

    config = SpeculativeConfig(method="suffix", prompt_lookup_min=1, num_speculative_tokens=4, verify_token_budget=2)
    stats = replay([([1, 2, 3], [[4, 5, 4, 5, 4, 5, 4, 5]])], config)
    assert (stats.steps, stats.plain_steps, stats.verify_steps) == (5, 7, 5)
    assert (stats.verify_seqs, stats.drafted, stats.accepted, stats.verify_tokens) == (5, 3, 2, 7)
    assert stats.query_tokens == 5 * 2 and abs(stats.token_speedup(0.5) - (7 + 3.5) / (5 + 5.0)) < 1e-12


def test_the_offline_replay_prices_a_round_by_its_live_rows_only():
    """Two samples, "4 5 4 5" and "6 7", after prompt 1 2 3. Round 1: neither finds its last token earlier (5, 7
    kept); the second sample is done, so rounds 2-3 price one row: round 2 keeps 4 (no earlier "5"), round 3's "4"
    drafts "5 4", but one token remains: 5 kept as the round's own. Rounds compute 2 x 5, then 1 x 5 and 1 x 5 tokens
    (4 draft tokens each); the plain generation 3 + 1 tokens in 3 steps."""
    from nonstop.rollout.spec.replay import replay

    config = SpeculativeConfig(method="suffix", prompt_lookup_min=1, num_speculative_tokens=4)
    stats = replay([([1, 2, 3], [[4, 5, 4, 5], [6, 7]])], config)
    assert (stats.steps, stats.plain_steps, stats.verify_seqs, stats.drafted, stats.accepted) == (3, 3, 4, 2, 0)
    assert (stats.query_tokens, stats.plain_tokens, stats.verify_tokens) == (20, 4, 4)
    assert abs(stats.token_speedup(0.1) - (3 + 0.4) / (3 + 2.0)) < 1e-12


def test_the_offline_replay_prices_plain_steps_above_the_range_by_their_rows():
    """Two samples of 3 tokens with a drafting range of 1 sequence: both stay live to the end, so every step is a
    plain step of 2 rows, 2 steps after the prefill's first token. Priced at 0.25 a token, both generations cost the
    same: 1.0."""
    from nonstop.rollout.spec.replay import replay

    config = SpeculativeConfig(method="suffix", prompt_lookup_min=1, num_speculative_tokens=4, disable_by_batch_size=1)
    stats = replay([([1, 2], [[3, 4, 5], [6, 7, 8]])], config)
    assert (stats.steps, stats.verify_steps, stats.plain_row_steps, stats.plain_tokens) == (2, 0, 4, 4)
    assert stats.token_speedup(0.25) == 1.0


def test_the_offline_replay_drafts_from_the_other_groups_samples_as_the_engine_lists_them():
    """Group 0 writes "10 11 ... 18" (sample A, done after 8 rounds) while its sample B, with nothing repeated, runs
    one round longer; group 1's only sample writes "20 21 22" and then A's text. Its "10" is followed, in A's stream
    only, by what it writes next, so with the other groups on it catches up with A and ends with B (9 rounds);
    with them off nothing it drafts from holds its tokens: 11 rounds of one token, as plain decoding."""
    from nonstop.rollout.spec.replay import replay

    A = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    groups = [([1], [A, list(range(30, 40))]), ([2], [[20, 21, 22, *A]])]
    config = SpeculativeConfig(method="suffix", prompt_lookup_min=1, num_speculative_tokens=4)
    on = replay(groups, config)
    off = replay(groups, dataclasses.replace(config, draft_from_other_groups=False))
    assert (off.steps, off.plain_steps, off.accepted) == (11, 11, 0)
    assert on.steps == 9 and on.accepted == 3
