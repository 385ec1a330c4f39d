"""Drafters for the speculative-decoding tests, an engine that verifies every launch in range (`always`), and a log of
chained verify launches."""

from __future__ import annotations

import torch

from nonstop.rollout import LLM, SamplingParams


class PartlyWrongDrafter:
    """A device drafter (rollout/spec/rounds.py) that drafts a plain run's continuation of each row (`sequences`: the
    plain run's prompt + output token lists; a row drafts from the first whose prefix is the row's tokens so far),
    with every `wrong_every`-th draft token replaced by another token, so verify rounds accept a prefix and reject
    the rest; `wrong_every=0` drafts the truth itself. Records each draft as (output position, tokens) (eager only:
    recording reads the device)."""

    def __init__(self, sequences: list[tuple[list[int], int]], vocab_size: int, wrong_every: int = 3):
        width = max(len(t) for t, _ in sequences)
        self.truth_TL = torch.full((len(sequences), width), -1, dtype=torch.int64)
        for i, (tokens, _) in enumerate(sequences):
            self.truth_TL[i, : len(tokens)] = torch.tensor(tokens)
        self.length_T = torch.tensor([len(t) for t, _ in sequences])
        self.prompt_T = torch.tensor([p for _, p in sequences])
        self.vocab_size, self.wrong_every = vocab_size, wrong_every
        self.drafts: list[tuple[int, list[int]]] = []

    @classmethod
    def from_outputs(cls, prompts, outputs, vocab_size: int, wrong_every: int = 3) -> PartlyWrongDrafter:
        sequences = [(list(p) + c.token_ids, len(p)) for p, o in zip(prompts, outputs, strict=True) for c in o.outputs]
        return cls(sequences, vocab_size, wrong_every)

    def __call__(self, tokens_SL, lengths_S, own_N, streams_NG, group_N, num_draft):
        device = tokens_SL.device
        if self.truth_TL.device != device:  # once, at the first (eager) call: a CUDA-graph capture copies nothing
            self.truth_TL, self.length_T = self.truth_TL.to(device), self.length_T.to(device)
        truth_TL, length_T = self.truth_TL, self.length_T
        width = min(tokens_SL.shape[1], truth_TL.shape[1])
        len_N = lengths_S[own_N]
        mine_NL = tokens_SL[own_N, :width].long()
        p_L = torch.arange(width, device=device)
        same_NTL = (truth_TL[None, :, :width] == mine_NL[:, None, :]) | (p_L >= len_N[:, None, None])
        match_NT = same_NTL.all(dim=2) & (length_T[None, :] > len_N[:, None]) & (len_N[:, None] <= width)
        found_N = match_NT.any(dim=1)
        t_N = match_NT.int().argmax(dim=1)
        at_ND = len_N[:, None] + torch.arange(num_draft, device=device)
        valid_ND = found_N[:, None] & (at_ND < length_T[t_N][:, None])
        drafts_ND = truth_TL[t_N[:, None], at_ND.clamp(max=truth_TL.shape[1] - 1)].clamp(min=0)
        if self.wrong_every:
            wrong_D = (torch.arange(num_draft, device=device) + 1) % self.wrong_every == 0
            drafts_ND = torch.where(wrong_D, (drafts_ND + 1) % self.vocab_size, drafts_ND)
        drafts_ND = torch.where(valid_ND, drafts_ND, 0)
        if device.type == "cpu":
            for n in found_N.nonzero().flatten().tolist():
                start = int(len_N[n]) - int(self.prompt_T[t_N[n]])
                self.drafts.append((start, drafts_ND[n][valid_ND[n]].tolist()))
        return drafts_ND, valid_ND.sum(dim=1)


def speculative_llm(model, drafter=None, num_speculative_tokens: int = 4, **engine_kwargs) -> LLM:
    """An engine that verifies every launch in the drafting range, with `drafter` in place of the suffix drafter."""
    spec = {"method": "suffix", "draft_rule": "always", "num_speculative_tokens": num_speculative_tokens}
    spec.update(engine_kwargs.pop("speculative_config", {}))
    llm = LLM(model, speculative_config=spec, **engine_kwargs)
    if drafter is not None:
        llm.llm_engine.model_runner.verify.drafter = drafter
    return llm


def host_stop_params(free, lengths: list[int], host_stopped: tuple[int, ...], vocab_size: int) -> list[SamplingParams]:
    """Greedy params of `lengths` tokens for the prompts of `free` (their greedy outputs, ignoring EOS); the requests
    `host_stopped` stop at their 7th output token by a stop id the verify rounds do not check (it comes with eight
    unused ones, more than a row holds), so only the host sees it."""
    params = []
    for i, (out, m) in enumerate(zip(free, lengths, strict=True)):
        tokens = out.outputs[0].token_ids
        stops = [tokens[6]] + [t for t in range(vocab_size) if t not in tokens][:8] if i in host_stopped else []
        params.append(SamplingParams(temperature=0, max_tokens=m, stop_token_ids=stops, ignore_eos=True))
    return params


class LaunchLog:
    """Each verify launch in order, with the rows it was told to kill (None: planned afresh), and each read's live
    rounds per row and whether the host still ran the row when it read the launch, in the same order (launches are
    read first in, first out)."""

    def __init__(self, engine, monkeypatch):
        self.kills, self.live, self.running = [], [], []
        runner, scheduler = engine.model_runner, engine.scheduler
        launch_verify, continue_verify = runner.launch_verify, runner.continue_verify
        keep_rounds = scheduler.keep_rounds

        def fresh(batch, group_of):
            self.kills.append(None)
            return launch_verify(batch, group_of)

        def chained(batch, finished):
            self.kills.append(list(finished))
            return continue_verify(batch, finished)

        def keep(batch, outcome):
            self.live.append(list(outcome.live_rounds))
            self.running.append([not seq.is_finished for seq in batch.seqs])
            return keep_rounds(batch, outcome)

        monkeypatch.setattr(runner, "launch_verify", fresh)
        monkeypatch.setattr(runner, "continue_verify", chained)
        monkeypatch.setattr(scheduler, "keep_rounds", keep)

    def assert_killed_rows_computed_nothing(self) -> None:
        """Some chained launch killed a row; in each such launch the killed rows were live in no round and some other
        row was."""
        killed = [(kill, live) for kill, live in zip(self.kills, self.live, strict=True) if kill and any(kill)]
        assert killed, "no chained launch killed a row"
        for kill, live in killed:
            assert all(rounds == 0 for rounds, k in zip(live, kill, strict=True) if k)
            assert any(rounds > 0 for rounds, k in zip(live, kill, strict=True) if not k)
