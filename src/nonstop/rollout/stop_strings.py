"""Stop strings (`SamplingParams.stop`, vLLM's): a sequence ends as soon as its decoded text contains one.

Only sequences that have stop strings are detokenized while they run, incrementally: each newly known token costs
two `tokenizer.decode` calls over a short window (the tokens since the last complete character, vLLM's
prefix/read offsets), so a byte-level token that ends inside a multi-byte character adds text only once the
character is whole. After each token, once `min_tokens` are out, the text's new tail (plus the longest stop
string's length less one, for a string completed across tokens) is searched; the first token whose text completes
a stop string ends the sequence there: its token ids run up to and including that token, its text stops before the
string (vLLM's defaults). Tokens computed past it (async scheduling, multi-step decode, a verify round's kept
draft) are dropped like those past a stop id.
"""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.rollout.sequence import FinishReason, Sequence


@dataclass
class _Detokenized:
    stop: list[str]
    text: str = ""
    prefix_offset: int = 0  # output tokens before the window: their text is already in `text`
    read_offset: int = 0  # output tokens whose text is in `text`
    num_checked: int = 0  # output tokens detokenized so far
    truncated: str | None = None  # the text before the stop string, once one was found


class StopStrings:
    """The running sequences that have stop strings, with their text so far."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.seqs: dict[int, tuple[Sequence, _Detokenized]] = {}
        self.finished: dict[int, _Detokenized] = {}  # by seq_id, until their request's output is built

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def add(self, seq: Sequence) -> None:
        stop = seq.sampling_params.stop
        if not stop:
            return
        if self.tokenizer is None:
            raise ValueError(f"request {seq.request_id!r}: stop strings need the engine's tokenizer")
        self.seqs[seq.seq_id] = (seq, _Detokenized(stop))

    def discard(self, seq: Sequence) -> None:
        self.seqs.pop(seq.seq_id, None)

    def check(self) -> list[tuple[Sequence, int]]:
        """Detokenize every tracked sequence's newly known tokens; (sequence, token index) for each whose text now
        contains a stop string, at the token that completed it. Finished sequences stop being tracked; one the update
        just ended at a stop id or max_tokens is searched first: a multi-token read (multi-step decode, a verify
        launch) can complete a stop string before that end, which then ends it instead."""
        hits = []
        for seq_id, (seq, state) in list(self.seqs.items()):
            aborted = seq.is_finished and seq.finish_reason == FinishReason.ABORT
            index = None if aborted else self._advance(seq, state)
            if index is not None:
                hits.append((seq, seq.num_prompt_tokens + index))
            if index is not None or seq.is_finished:
                self.seqs.pop(seq_id)
                self.finished[seq_id] = state
        return hits

    def text(self, seq: Sequence) -> str | None:
        """The text of a sequence a stop string ended (cut before the string); None for any other. Called once per
        sequence, when its request's output is built: the sequence is forgotten."""
        self.seqs.pop(seq.seq_id, None)
        state = self.finished.pop(seq.seq_id, None)
        return state.truncated if state is not None else None

    def _advance(self, seq: Sequence, state: _Detokenized) -> int | None:
        output = seq.token_ids[seq.num_prompt_tokens : seq.num_known_tokens]
        min_tokens = seq.sampling_params.min_tokens
        longest = max(map(len, state.stop))
        decode = self.tokenizer.decode
        for i in range(state.num_checked, len(output)):
            state.num_checked = i + 1
            before = decode(output[state.prefix_offset : state.read_offset], skip_special_tokens=True)
            after = decode(output[state.prefix_offset : i + 1], skip_special_tokens=True)
            if len(after) <= len(before) or after.endswith("\ufffd"):
                continue  # no new character yet (a special token, or a character split across tokens)
            new = after[len(before) :]
            state.text += new
            state.prefix_offset, state.read_offset = state.read_offset, i + 1
            if i + 1 < min_tokens:
                continue  # vLLM's rule: no stop string ends a sequence before min_tokens
            window = len(state.text) - len(new) - longest + 1
            found = [at for s in state.stop if (at := state.text.find(s, max(0, window))) >= 0]
            if found:
                state.truncated = state.text[: min(found)]
                return i
        return None
