"""The Triton verify-round bookkeeping (kernels/verify_round_triton.py) against `round_inputs_reference` and
`accept_round_reference`: the same query-slot inputs and the same kept tokens, stream writes, row state and `out_W`,
on random rounds with padding rows, a finished row, rows at their max length and partial KV reservations, drafts of
0 and D tokens, and stop ids before and after min_tokens. On CUDA, a round's three calls (drafter included) captured
in one CUDA graph replay new values as the references compute them.

Legend: N rows (the last two padding), Q = D + 1 query slots per row, T = N x Q, M block-table width, B block size,
S streams (the last one scratch), L stream capacity, E stop ids per row, G streams per row.
"""

import pytest
import torch
from interpreter import run_under_interpreter

from nonstop.kernels.verify_round import (
    accept_round,
    accept_round_reference,
    round_inputs,
    round_inputs_reference,
)
from nonstop.rollout.spec.suffix_match import suffix_match_drafts, suffix_match_drafts_reference

STOP = 99  # row 0's stop id, outside the random token ids
# The arguments of each call, by name, in order.
ROUND_INPUTS = tuple(
    "drafts_ND draft_len_N cached_N last_N live_N kv_cap_N prompt_N block_tables_NM ids_T positions_T slots_T "
    "sample_pos_T context_lens_N num_query_N".split()
)
ACCEPT = tuple(
    "y_T logprobs_T ids_T draft_len_N cached_N last_N live_N max_len_N prompt_N min_tokens_T stop_ids_NE own_N "
    "tokens_SL lengths_S out_W".split()
)


def make_round(seed: int, N: int, D: int, E: int, L: int, B: int, vocab: int, G: int = 4, device="cpu") -> dict:
    """A round's state as the planner stages it. Live rows own streams 0..N-3 holding their tokens up to the last
    (position c); rows N-2, N-1 are padding (not live, own the scratch stream, no streams, KV into the scratch block).
    Row 0 drafts D tokens with STOP at draft slots 1 and 3 and min_tokens banning stops before slot 2; row 1 drafts
    nothing; rows 2 and 3 sit one and two tokens below their max length; row 4 finished in an earlier round. D >= 4."""
    gen = torch.Generator().manual_seed(seed)
    Q, S, M = D + 1, N + 1, -(-L // B)

    def randint(low, high, shape=(N,)):
        return torch.randint(low, high, shape, generator=gen)

    prompt_N = randint(1, 10)
    max_len_N = torch.minimum(prompt_N + randint(8, L), torch.tensor(L))
    cached_N = prompt_N - 1 + (torch.rand(N, generator=gen) * (max_len_N - prompt_N - 1)).long()
    cached_N[0] = torch.minimum(cached_N[0], max_len_N[0] - 5)  # room for four kept tokens
    cached_N[2:4] = max_len_N[2:4] - torch.tensor([2, 3])
    kv_cap_N = cached_N + randint(-2, Q + 3)
    draft_len_N = randint(0, D + 1)
    draft_len_N[:2] = torch.tensor([D, 0])
    drafts_ND = randint(0, vocab, (N, D))  # garbage past each draft, as the reference must ignore
    drafts_ND[0, 1] = drafts_ND[0, 3] = STOP
    stop_ids_NE = torch.where(torch.rand(N, E, generator=gen) < 0.6, randint(0, vocab, (N, E)), -1)
    stop_ids_NE[0] = torch.tensor([STOP] + [-1] * (E - 1))
    min_tokens_N = cached_N + 1 - prompt_N + randint(-2, Q + 2)
    min_tokens_N[0] = cached_N[0] + 3 - prompt_N[0] + 1  # out position + 1 >= min_tokens from slot 2 on
    tokens_SL = torch.randint(0, vocab, (S, L), generator=gen, dtype=torch.int32)
    lengths_S = torch.randint(1, L + 1, (S,), generator=gen)
    own_N = torch.arange(N)
    lengths_S[: N - 2] = cached_N[: N - 2] + 1
    last_N = randint(0, vocab)
    tokens_SL[own_N, cached_N.clamp(max=L - 1)] = last_N.int()  # the last token ends the row's stream
    streams_NG = torch.where(torch.rand(N, G, generator=gen) < 0.7, randint(0, S - 1, (N, G)), -1)
    streams_NG[:, 0] = own_N
    live_N = torch.ones(N, dtype=torch.int64)
    live_N[4] = 0
    block_tables_NM = torch.randint(0, 5000, (N, M), generator=gen, dtype=torch.int32)
    padding = slice(N - 2, N)
    for t, value in ((cached_N, 0), (max_len_N, 2), (kv_cap_N, 0), (prompt_N, 0), (own_N, S - 1), (live_N, 0),
                     (streams_NG, -1), (stop_ids_NE, -1), (min_tokens_N, 0)):  # fmt: skip
        t[padding] = value
    block_tables_NM[padding, 0] = 7
    T = N * Q
    state = {
        "drafts_ND": drafts_ND, "draft_len_N": draft_len_N, "cached_N": cached_N, "last_N": last_N,
        "live_N": live_N, "kv_cap_N": kv_cap_N, "prompt_N": prompt_N, "block_tables_NM": block_tables_NM,
        "ids_T": randint(0, 10**6, (T,)), "positions_T": randint(0, 10**6, (T,)), "slots_T": randint(0, 10**6, (T,)),
        "sample_pos_T": randint(0, 10**6, (T,)), "context_lens_N": randint(0, 10**6).int(),
        "num_query_N": randint(0, 10**6).int(), "y_T": torch.zeros(T, dtype=torch.int64),
        "logprobs_T": -torch.rand(T, generator=gen), "max_len_N": max_len_N,
        "min_tokens_T": min_tokens_N.repeat_interleave(Q), "stop_ids_NE": stop_ids_NE, "own_N": own_N,
        "tokens_SL": tokens_SL, "lengths_S": lengths_S, "out_W": torch.rand(2 * T + 3 * N + 5, generator=gen).double(),
        "streams_NG": streams_NG,
    }  # fmt: skip
    return {name: t.to(device) for name, t in state.items()}


def sample_agreeing(seed: int, state: dict, vocab: int) -> None:
    """state["y_T"]: random samples that agree with each row's draft (`ids_T` slots 1..) for a random prefix of it,
    all of it for row 0."""
    gen = torch.Generator().manual_seed(seed)
    draft_len_N = state["draft_len_N"].cpu()
    N = draft_len_N.shape[0]
    ids_NQ = state["ids_T"].cpu().view(N, -1)
    y_NQ = torch.randint(0, vocab, ids_NQ.shape, generator=gen)
    agree_N = (torch.rand(N, generator=gen) * (draft_len_N + 1)).long()
    agree_N[0] = draft_len_N[0]
    for n, a in enumerate(agree_N.tolist()):
        y_NQ[n, :a] = ids_NQ[n, 1 : 1 + a]
    state["y_T"].copy_(y_NQ.view(-1))


def args(state: dict, names: tuple[str, ...]) -> list:
    return [state[name] for name in names]


def assert_states_equal(got: dict, want: dict, case: str) -> None:
    """Every tensor equal, but the scratch stream's first token (the reference's masked writes land there)."""
    want["tokens_SL"][-1, 0] = got["tokens_SL"][-1, 0]
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), f"{case}: {name}"


def check_case(inputs, accept, seed: int, N: int, D: int, E: int, L: int, B: int, vocab: int, device="cpu") -> None:
    got = make_round(seed, N, D, E, L, B, vocab, device=device)
    want = {name: t.clone() for name, t in got.items()}
    constants = (B, 7 * B, L - 4)  # block size, scratch slot, max position
    case = f"seed={seed} N={N} D={D} E={E} L={L} B={B}"
    round_inputs_reference(*args(want, ROUND_INPUTS), *constants)
    inputs(*args(got, ROUND_INPUTS), *constants)
    assert_states_equal(got, want, case)
    sample_agreeing(seed, want, vocab)
    got["y_T"].copy_(want["y_T"])
    accept_round_reference(*args(want, ACCEPT))
    accept(*args(got, ACCEPT))
    assert_states_equal(got, want, case)
    T = N * (D + 1)
    kept_N, live_N = want["out_W"][2 * T : 2 * T + N].long().cpu(), want["live_N"].cpu()
    assert kept_N[0] == 4 and live_N[0] == 0, "row 0 skips the stop before min_tokens and keeps the one after"
    assert kept_N[2] == 1 and live_N[2] == 0 and kept_N[3] <= 2, "rows at their max length"
    assert (kept_N[[4, N - 2, N - 1]] == 0).all() and live_N[: N - 2].any(), "rows not live keep nothing"


# (N, D, E, L, B, vocab)
INTERPRETER_CASES = [(16, 4, 3, 64, 16, 6), (12, 7, 8, 200, 32, 4), (10, 5, 3, 48, 8, 3), (7, 5, 1, 40, 8, 3)]


def check_kernels_under_interpreter() -> None:
    from nonstop.kernels.verify_round_triton import accept_round_triton, round_inputs_triton

    for i, case in enumerate(INTERPRETER_CASES):
        check_case(round_inputs_triton, accept_round_triton, 90 + i, *case)


def test_triton_interpreter_matches_reference():
    run_under_interpreter("test_verify_round", "check_kernels_under_interpreter")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(10, 4, 8, 512, 16, 6), (64, 7, 8, 4096, 16, 3), (33, 4, 2, 96, 32, 2)])
def test_triton_matches_reference_on_cuda(case):
    from nonstop.kernels.verify_round_triton import accept_round_triton, round_inputs_triton

    with torch.inference_mode():
        check_case(round_inputs_triton, accept_round_triton, sum(case), *case, device="cuda")
        check_case(round_inputs, accept_round, sum(case) + 1, *case, device="cuda")  # through the dispatchers


@pytest.mark.gpu
def test_a_captured_round_replays_new_values():
    """Drafter, slot inputs and acceptance captured once in a CUDA graph; each replay, on new values copied into
    the captured tensors, gives what the references compute on those values."""
    N, D, E, L, B, vocab, max_match, min_match = 16, 4, 4, 700, 16, 3, 8, 1
    constants = (B, 7 * B, L - 4)
    with torch.inference_mode():
        static = make_round(1, N, D, E, L, B, vocab, device="cuda")

        def run_round() -> tuple:
            drafts_ND, draft_len_N = suffix_match_drafts(static["tokens_SL"], static["lengths_S"], static["own_N"],
                                                         static["streams_NG"], D, max_match, min_match)  # fmt: skip
            state = {**static, "drafts_ND": drafts_ND, "draft_len_N": draft_len_N}
            round_inputs(*args(state, ROUND_INPUTS), *constants)
            accept_round(*args(state, ACCEPT))
            return drafts_ND, draft_len_N

        run_round()  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            drafts_ND, draft_len_N = run_round()
        for seed in (2, 3, 4):
            want = make_round(seed, N, D, E, L, B, vocab, device="cuda")
            want["drafts_ND"], want["draft_len_N"] = suffix_match_drafts_reference(
                want["tokens_SL"], want["lengths_S"], want["own_N"], want["streams_NG"], D, max_match, min_match
            )
            fresh = {name: t.clone() for name, t in want.items()}
            round_inputs_reference(*args(want, ROUND_INPUTS), *constants)
            sample_agreeing(seed, want, vocab)  # y from the drafts this replay will find
            fresh["y_T"].copy_(want["y_T"])
            accept_round_reference(*args(want, ACCEPT))
            for name, t in static.items():
                t.copy_(fresh[name])
            graph.replay()
            torch.cuda.synchronize()
            assert (want["draft_len_N"] > 0).any(), "the replay drafts"
            assert_states_equal({**static, "drafts_ND": drafts_ND, "draft_len_N": draft_len_N}, want, f"seed={seed}")
