"""The Triton drafter (kernels/suffix_match_triton.py) against `suffix_match_drafts_reference`: the same drafts and
draft lengths on random streams over a few token ids (many matches, long ones), with padding rows, absent and
duplicate stream slots, empty and one-token streams, streams longer than a block, exact ties between streams, and
rows whose listed streams are partly another group's (ranked below the row's group at equal matches).

Legend: S streams (the last one scratch), L stream capacity, N rows, G streams per row, D draft tokens.
"""

from contextlib import contextmanager

import pytest
import torch
from interpreter import run_under_interpreter

from nonstop.rollout.spec.suffix_match import suffix_match_drafts, suffix_match_drafts_reference


def plant_tie(tokens_SL, lengths_S, rows, own_N, streams_NG, D: int, max_match: int, vocab: int) -> list:
    """Two streams a, b that both end in a row's latest `max_match` tokens at the same position q, each with D known
    tokens after it but different ones; rows[0] lists a before b, rows[1] b before a. The planted tokens (ids >= vocab)
    appear nowhere else, so (match, continuation, position) ties exactly and the first stream listed must win.
    Returns [(row, winning stream, q)]."""
    a, b = (int(s) for s in streams_NG[rows[0], 1:3])
    x = vocab + torch.arange(max_match, dtype=tokens_SL.dtype)
    q = max_match + 3
    for s in (a, b):
        tokens_SL[s, q - max_match + 1 : q + 1] = x
        lengths_S[s] = q + 1 + D + 1
    tokens_SL[a, q + 1 : q + 2 + D] = vocab + 100 + torch.arange(D + 1, dtype=tokens_SL.dtype)
    tokens_SL[b, q + 1 : q + 2 + D] = vocab + 200 + torch.arange(D + 1, dtype=tokens_SL.dtype)
    streams_NG[rows[1], 1:3] = torch.tensor([b, a])
    for n in rows:
        own = int(own_N[n])
        end = max(int(lengths_S[own]), max_match + 1)
        tokens_SL[own, end - max_match : end] = x
        lengths_S[own] = end
    return [(rows[0], a, q), (rows[1], b, q)]


def plant_stream_start(tokens_SL, lengths_S, n: int, own: int, c: int, d: int, vocab: int) -> None:
    """Row n's latest tokens u0 u1 u2 (ids >= vocab) against stream c, which begins with u1 u2 right after stream
    c - 1's last column holding u0, and stream d, which holds u1 u2 later: a match stops at its stream's start, so d
    (the later of two 2-token matches) must win, not c read as a 3-token match through the table's memory."""
    u = vocab + 300 + torch.arange(3, dtype=tokens_SL.dtype)
    end = max(int(lengths_S[own]), 4)
    tokens_SL[own, end - 3 : end] = u
    lengths_S[own] = end
    tokens_SL[c, :2], tokens_SL[c - 1, -1] = u[1:], u[0]
    tokens_SL[d, 5:7] = u[1:]
    lengths_S[d] = max(int(lengths_S[d]), 8)


def make_case(seed: int, N: int, G: int, L: int, D: int, max_match: int, vocab: int, device="cpu"):
    """N rows, the last two padding (own = the scratch stream, no streams); live rows own streams 3.. and draft from
    their own, then random others (repeats allowed) with absent slots (-1) among them. Lengths 1..L, and among the
    streams an empty, a one-token (the last live row's own) and a full one; row 3 lists its own twice. Rows 0 and 1
    (listing streams 1 and 2 after their own) get an exact tie, row 2 a match at a stream's start."""
    gen = torch.Generator().manual_seed(seed)
    live, S = N - 2, N + 6
    empty, single, full, later = N + 1, N + 2, N + 3, N + 4
    tokens_SL = torch.randint(0, vocab, (S, L), generator=gen, dtype=torch.int32)
    lengths_S = torch.randint(1, L + 1, (S,), generator=gen)
    lengths_S[[empty, single, full]] = torch.tensor([0, 1, L])
    own_N = torch.cat([torch.arange(3, 2 + live), torch.tensor([single]), torch.full((2,), S - 1)])
    streams_NG = torch.randint(0, S - 1, (N, G), generator=gen)
    streams_NG[torch.rand(N, G, generator=gen) < 0.25] = -1
    streams_NG[:, 0] = own_N
    streams_NG[:2, 1:3] = torch.tensor([1, 2])
    streams_NG[2, 1:3] = torch.tensor([full, later])
    streams_NG[3, -1] = own_N[3]  # a repeated stream
    streams_NG[live:] = -1
    group_N = torch.randint(1, G + 1, (N,), generator=gen)
    group_N[:2], group_N[live:] = G, 0
    ties = plant_tie(tokens_SL, lengths_S, (0, 1), own_N, streams_NG, D, max_match, vocab)
    plant_stream_start(tokens_SL, lengths_S, 2, int(own_N[2]), full, later, vocab)
    tensors = [t.to(device) for t in (tokens_SL, lengths_S, own_N, streams_NG, group_N)]
    return tensors, ties


def check_case(run, seed: int, N: int, G: int, L: int, D: int, max_match: int, min_match: int, vocab: int,
               device="cpu") -> list[int]:  # fmt: skip
    """Compares `run` with the reference; returns the live rows' draft lengths (for the callers' coverage checks)."""
    (tokens_SL, lengths_S, own_N, streams_NG, group_N), ties = make_case(seed, N, G, L, D, max_match, vocab, device)
    inputs = [t.clone() for t in (tokens_SL, lengths_S, own_N, streams_NG, group_N)]
    want_drafts, want_len = suffix_match_drafts_reference(tokens_SL, lengths_S, own_N, streams_NG, group_N, D,
                                                          max_match, min_match)  # fmt: skip
    got_drafts, got_len = run(tokens_SL, lengths_S, own_N, streams_NG, group_N, D, max_match, min_match)
    case = f"seed={seed} N={N} G={G} L={L} D={D} max_match={max_match} min_match={min_match}"
    assert got_len.dtype == want_len.dtype == got_drafts.dtype == torch.int64, case
    assert torch.equal(got_len, want_len), f"{case}: {got_len.tolist()} != {want_len.tolist()}"
    assert torch.equal(got_drafts, want_drafts), case
    for before, after in zip(inputs, (tokens_SL, lengths_S, own_N, streams_NG, group_N), strict=True):
        assert torch.equal(before, after), f"{case}: an input changed"
    assert (want_len[-2:] == 0).all(), "padding rows draft nothing"
    for n, stream, q in ties:  # the first listed of the two tied streams wins
        assert torch.equal(want_drafts[n], tokens_SL[stream, q + 1 : q + 1 + D].long()), case
    return want_len[:-2].tolist()  # the live rows'


@contextmanager
def block_size(block: int | None):
    """The scan's block size for a case: small ones make short streams span several blocks (None: the kernel's)."""
    import nonstop.kernels.suffix_match_triton as module

    saved = module._BLOCK
    module._BLOCK = block or saved
    try:
        yield
    finally:
        module._BLOCK = saved


# (N, G, L, D, max_match, min_match, vocab, block)
INTERPRETER_CASES = [
    (9, 4, 150, 4, 3, 1, 3, 32),
    (8, 8, 200, 8, 16, 2, 4, 64),
    (8, 3, 90, 1, 1, 1, 2, 16),
    (6, 3, 1300, 6, 5, 2, 5, None),
]


def check_kernel_under_interpreter() -> None:
    from nonstop.kernels.suffix_match_triton import suffix_match_drafts_triton

    lengths, num_drafts = [], []
    for i, (*case, block) in enumerate(INTERPRETER_CASES):
        with block_size(block):
            got = check_case(suffix_match_drafts_triton, 70 + i, *case)
        lengths += got
        num_drafts += [case[3]] * len(got)
    assert 0 in lengths and any(n == d for n, d in zip(lengths, num_drafts, strict=True)), "drafts of 0 and D tokens"


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_suffix_match", "check_kernel_under_interpreter")


GPU_CASES = [  # (N, G, L, D, max_match, min_match, vocab)
    (8, 4, 300, 4, 16, 2, 3),
    (64, 32, 4096, 8, 16, 2, 50),
    (33, 7, 2500, 6, 4, 1, 2),
    (16, 16, 64, 1, 1, 1, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_triton_matches_reference_on_cuda(case):
    from nonstop.kernels.dispatch import use_fused_index_kernel
    from nonstop.kernels.suffix_match_triton import suffix_match_drafts_triton

    with torch.inference_mode():
        assert use_fused_index_kernel(torch.zeros(1, dtype=torch.int64, device="cuda"))  # what the engine gets
        check_case(suffix_match_drafts_triton, sum(case), *case, device="cuda")
        check_case(suffix_match_drafts, sum(case) + 1, *case, device="cuda")  # through the dispatcher


def check_replay_under_interpreter() -> list[int]:
    """The offline replay (rollout/spec/replay.py) with the Triton drafter, as `bench spec` runs it on a GPU, against
    the replay with the reference: two prompts x 3 samples over 3 token ids (long matches), lengths 6-24, a budget
    that narrows the widest rounds. Returns the rounds, so the caller sees the case drafted."""
    import random

    import nonstop.rollout.spec.replay as module
    from nonstop.config.rollout import SpeculativeConfig
    from nonstop.kernels.suffix_match_triton import suffix_match_drafts_triton

    rng = random.Random(5)
    groups = [([7, 8, 9][: 2 + g], [[rng.randrange(3) for _ in range(rng.randrange(6, 25))] for _ in range(3)])
              for g in range(2)]  # fmt: skip
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4, verify_token_budget=12, prompt_lookup_max=5)
    want = module.replay(groups, config)
    reference = module.suffix_match_drafts
    module.suffix_match_drafts = suffix_match_drafts_triton
    try:
        with block_size(16):
            got = module.replay(groups, config)
    finally:
        module.suffix_match_drafts = reference
    assert got == want, (got, want)
    assert want.accepted > 0, "the case keeps drafts"
    return [want.verify_steps, want.plain_steps]


def test_the_offline_replay_with_the_triton_drafter_equals_the_reference_replay():
    rounds, plain = run_under_interpreter("test_suffix_match", "check_replay_under_interpreter")
    assert 0 < rounds < plain
