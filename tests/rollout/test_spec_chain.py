"""Chained verify launches (LLMEngine._chained_verify): the next launch on the same rows goes to the device before the
one in flight is read. Outputs stay those of plain decoding; a row the host ends meanwhile (a stop the rounds do not
check) is killed in the launch after next and computes nothing there; the KV reserved for a chained launch covers
both launches' worst case; the draft rule's gain is the rows' harmonic mean."""

import pytest
from rollout_helpers import TINY, make_pair, random_prompts
from spec_helpers import LaunchLog, PartlyWrongDrafter, host_stop_params, speculative_llm

from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.spec.policy import launch_gain

V = TINY["vocab_size"]


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama", seed=3)


def three_groups(model, seed: int, max_tokens: int):
    """Three prompts x 2 greedy samples of `max_tokens`, their plain outputs, and an engine (4 rounds a launch) whose
    drafter drafts those outputs with planted errors."""
    prompts = random_prompts([5, 9, 13], seed=seed)
    params = SamplingParams(n=2, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM(model, block_size=4).generate(prompts, params)
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, plain, V), block_size=4,
                          num_scheduler_steps=4)  # fmt: skip
    return llm, prompts, params, plain


def test_chained_launches_keep_plain_outputs_and_kill_rows_the_host_ended(llama, monkeypatch):
    """Six requests of different lengths; two of them stop at a token the rounds do not check (more stop ids than
    they hold), so the host ends them while the next launch is already on the device. A small KV pool makes the
    blocks they free go to the other rows' next reservations."""
    _, model = llama
    prompts = random_prompts([5, 9, 13, 7, 11, 6], seed=4)
    lengths = [30, 24, 70, 18, 36, 28]  # the third runs past the first launches' draft window (64 tokens)
    free = LLM(model, block_size=4).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    )
    params = host_stop_params(free, lengths, (1, 4), V)
    kwargs = dict(block_size=4, num_kv_blocks=72)
    plain = LLM(model, **kwargs).generate(prompts, params)
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, free, V), **kwargs)
    engine = llm.llm_engine
    log = LaunchLog(engine, monkeypatch)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].finish_reason for o in out] == [o.outputs[0].finish_reason for o in plain]
    stats = llm.stats
    assert stats.num_chained_launches > 0 and stats.num_verify_launches > stats.num_chained_launches
    assert len(log.kills) == len(log.live) == stats.num_verify_launches
    log.assert_killed_rows_computed_nothing()
    # A row the host ended was live in the launch chained behind the one that ended it: those tokens were dropped.
    assert stats.num_discarded_tokens > 0
    # Verify rounds count those with a row the host still ran live (a row is live in its first rounds): not the rounds
    # in which only such dropped rows were.
    rounds = [max((r for r, run in zip(live, running, strict=True) if run), default=0)
              for live, running in zip(log.live, log.running, strict=True)]  # fmt: skip
    assert stats.num_verify_steps == sum(rounds)


def test_no_launch_is_chained_behind_one_that_reaches_every_rows_max_tokens(llama, monkeypatch):
    """Once every running row is expected to reach max_tokens within the launch in flight (at the rule's kept tokens
    a round), nothing is chained behind it: every verify launch has a live row. (Without the check the last launch
    here has none.)"""
    llm, prompts, params, plain = three_groups(llama[1], seed=5, max_tokens=23)
    log = LaunchLog(llm.llm_engine, monkeypatch)
    out = llm.generate(prompts, params)
    assert [c.token_ids for o in out for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    assert llm.stats.num_chained_launches > 0
    assert all(any(rounds > 0 for rounds in live) for live in log.live)


def test_a_chained_launch_reserves_two_launches_of_rounds_and_ends_the_chain_when_they_do_not_fit(llama):
    """`Scheduler.extend_rounds`: blocks for 2 x rounds x query slots past each sequence's last known token (within
    max_tokens), or None, allocating nothing, when the free blocks are too few."""
    _, model = llama
    llm = speculative_llm(model, block_size=4, num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("a", random_prompts([6], seed=1)[0], SamplingParams(temperature=0, max_tokens=30))
    while not engine.scheduler.running or engine.scheduler.running[0].num_cached_tokens < 6:
        engine.step()
    engine._process_in_flight()
    seq = engine.scheduler.running[0]
    batch = engine.scheduler.schedule((1, 5))
    assert batch.num_rounds == 1 and batch.kv_capacity == [seq.num_cached_tokens + 5]
    extended = engine.scheduler.extend_rounds(batch)
    cap = seq.num_cached_tokens + 2 * 5
    assert extended.kv_capacity == [cap] and len(seq.block_table) == -(-cap // 4)
    assert batch.kv_capacity == [seq.num_cached_tokens + 5]  # the launch in flight keeps its own batch
    bm = engine.block_manager
    taken = bm.allocate_blocks(bm.num_free_blocks)
    held = list(seq.block_table)
    far = engine.scheduler.extend_rounds(type(batch)(**{**vars(batch), "num_rounds": 4}))
    assert far is None and seq.block_table == held
    bm.release_blocks(taken)


def test_the_gain_is_the_rows_harmonic_mean_weighted_by_live_rounds():
    # Rows keeping 8 tokens in 4 rounds (2 a round) and 2 in 2 (1 a round): 6 rounds over 4 / 2 + 2 / 1 = 4.
    assert launch_gain([8, 2], [4, 2]) == pytest.approx(1.5)
    # A row the host had ended (nothing kept, no round) does not count; no live row at all: nothing to learn.
    assert launch_gain([8, 0, 2], [4, 0, 2]) == pytest.approx(1.5)
    assert launch_gain([0, 0], [0, 0]) is None
    # Equal rows: their common gain.
    assert launch_gain([6, 6, 6], [3, 3, 3]) == pytest.approx(2.0)


def test_the_step_log_names_what_each_step_launched(llama, monkeypatch):
    """Each engine step's log entry says what it launched (the bench's breakdown of a generation's time reads it): the
    verify and chained entries count the engine's verify and chained launches, the first step prefills. A step's time
    is the whole step's: on a clock that moves only while a chained launch's KV is reserved (10 s each time, before
    the launch), every chained step took 10 s and every other step none."""
    from types import SimpleNamespace

    import nonstop.rollout.llm_engine as engine_module
    from nonstop.rollout.scheduler import Scheduler

    llm, prompts, params, _ = three_groups(llama[1], seed=6, max_tokens=40)
    now = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    extend_rounds = Scheduler.extend_rounds

    def slow_extend(self, batch):
        now[0] += 10.0
        return extend_rounds(self, batch)

    monkeypatch.setattr(Scheduler, "extend_rounds", slow_extend)
    engine = llm.llm_engine
    with engine.stats_window() as window:
        llm.generate(prompts, params)
    kinds = [step.launch for step in window.steps]
    stats = llm.stats
    assert kinds[0] == "prefill"
    assert kinds.count("chained") == stats.num_chained_launches > 0
    assert kinds.count("verify") + kinds.count("chained") == stats.num_verify_launches
    assert set(kinds) <= {"prefill", "decode", "verify", "chained", ""}
    assert all(step.decode == (step.launch != "prefill") for step in window.steps)
    assert [s.wall_s for s in window.steps] == [10.0 if kind == "chained" else 0.0 for kind in kinds]


def test_a_launch_planned_afresh_is_timed_from_the_read_before_its_planning(llama, monkeypatch):
    """The device idles while the host reads a launch, schedules and plans the next one afresh (a chain hides that
    behind the device): the draft rule's time for a fresh launch starts at that read. On a clock that moves only
    while a verify launch is scheduled (10 s each time), every fresh launch of 4 rounds is timed 2.5 s a round and
    every chained one 0. (Timed from its launch, a fresh one was 0 too.)"""
    from types import SimpleNamespace

    import nonstop.rollout.llm_engine as engine_module
    from nonstop.rollout.scheduler import Scheduler

    llm, prompts, params, _ = three_groups(llama[1], seed=7, max_tokens=60)
    now = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    schedule = Scheduler.schedule

    def slow_verify_schedule(self, *args, **kwargs):
        if args or kwargs:  # a verify launch's rounds
            now[0] += 10.0
        return schedule(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "schedule", slow_verify_schedule)
    policy, timed = llm.llm_engine.speculator.policy, []
    verified = policy.verified

    def record(gain, round_s, decision=None):
        timed.append(round_s)
        return verified(gain, round_s, decision)

    monkeypatch.setattr(policy, "verified", record)
    llm.generate(prompts, params)
    stats = llm.stats
    fresh = stats.num_verify_launches - stats.num_chained_launches
    assert stats.num_chained_launches > 0 and fresh > 0
    assert sorted(timed) == [0.0] * stats.num_chained_launches + [2.5] * fresh


def test_rounds_in_which_only_rows_the_host_ended_were_live_are_no_verify_steps(llama, monkeypatch):
    """Two requests: the longer one stops at a token only the host sees, while the launch behind it is already on the
    device; there the shorter one ends in round 2 and the ended row runs all 4 rounds. Verify steps count the rounds
    with a row the host still ran: 4 + 2, not 4 + 4 (a high `verify_step_frac` otherwise)."""
    _, model = llama
    prompts = random_prompts([5, 9], seed=4)
    lengths = [18, 40]
    free = LLM(model, block_size=4).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    )
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, free, V), block_size=4,
                          num_scheduler_steps=4)  # fmt: skip
    log = LaunchLog(llm.llm_engine, monkeypatch)
    llm.generate(prompts, host_stop_params(free, lengths, (1,), V))
    assert log.live == [[4, 4], [2, 4]] and log.running == [[True, True], [True, False]]
    assert llm.stats.num_verify_steps == 6


def test_a_chain_goes_on_when_fewer_rows_would_only_draft_one_more_token(llama, monkeypatch):
    """64 rows (bucket 64: 3 draft tokens within the 256-token budget); 24 end at 10 tokens, leaving 40 (bucket 48
    would draft 4). The chain goes on in the 64-row shape (one launch planned afresh, the first): a re-plan idles the
    device for the host's read and planning. Outputs stay plain decoding's."""
    _, model = llama
    prompts = random_prompts([5, 9, 13, 7, 11, 6, 8, 10], seed=8)
    params = [SamplingParams(n=8, temperature=0, max_tokens=10 if i < 3 else 40, ignore_eos=True) for i in range(8)]
    plain = LLM(model, block_size=4, max_num_seqs=64).generate(prompts, params)
    llm = speculative_llm(model, PartlyWrongDrafter.from_outputs(prompts, plain, V), block_size=4, max_num_seqs=64,
                          speculative_config={"disable_by_batch_size": 64})  # fmt: skip
    runner = llm.llm_engine.model_runner
    assert [runner.verify.num_query_for(n) for n in (64, 40)] == [4, 5]
    log = LaunchLog(llm.llm_engine, monkeypatch)
    out = llm.generate(prompts, params)
    assert [c.token_ids for o in out for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    assert log.kills.count(None) == 1 and len(log.kills) > 2
    # The 64-row launches went on after the 24 rows had ended (read as ended, then killed).
    assert any(sum(running) == 40 for running in log.running) and any(kill and any(kill) for kill in log.kills)


def test_every_step_is_logged_including_the_read_that_ends_a_chain(llama):
    """The step that reads a chain's last verify launch and finds nothing left to run (on a GPU it waits for that
    launch's rounds) is logged as a step like plain decoding's last read, not left outside every step."""
    _, model = llama
    llm, prompts, params, plain = three_groups(model, seed=8, max_tokens=40)
    engine = llm.llm_engine
    calls, step = [], engine.step
    engine.step = lambda: calls.append(1) or step()
    with engine.stats_window() as window:
        out = llm.generate(prompts, params)
    assert [c.token_ids for o in out for c in o.outputs] == [c.token_ids for o in plain for c in o.outputs]
    assert llm.stats.num_chained_launches > 0
    assert len(window.steps) == len(calls)
    assert window.steps[-1].launch == ""  # the read that ended the chain
