"""Stop strings (`SamplingParams.stop`): incremental detokenization on hand-built sequences, and the engine's outputs
(token ids up to the token that completed the string, text cut before it) under async multi-step decode."""

import pytest
from rollout_helpers import make_pair, random_prompts

from nonstop.rollout import LLM, SamplingParams
from nonstop.rollout.sequence import Sequence
from nonstop.rollout.stop_strings import StopStrings


class ByteTokenizer:
    """Token 13 is the UTF-8 lead byte of "é" and 14 its continuation byte; token i is "<i>" otherwise."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        pieces = {13: b"\xc3", 14: b"\xa9"}
        return b"".join(pieces.get(t, f"<{t}>".encode()) for t in ids).decode("utf-8", errors="replace")


def sequence(output: list[int], **params) -> Sequence:
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=32, **params), seed=0)
    seq.token_ids += output
    return seq


def test_a_stop_string_is_found_at_the_token_that_completes_it():
    stops = StopStrings(ByteTokenizer())
    seq = sequence([5, 6], stop=["6><7"])
    stops.add(seq)
    assert stops.check() == []
    seq.token_ids += [7, 8]
    assert stops.check() == [(seq, seq.num_prompt_tokens + 2)]  # completed by token 7, output index 2
    assert stops.text(seq) == "<5><" and not stops  # the text stops before the string


def test_a_character_split_across_tokens_is_matched_whole():
    stops = StopStrings(ByteTokenizer())
    seq = sequence([13], stop="é")
    stops.add(seq)
    assert stops.check() == []  # "\ufffd" so far: no character yet
    seq.token_ids += [14, 3]
    assert stops.check() == [(seq, seq.num_prompt_tokens + 1)]
    assert stops.text(seq) == ""


def test_min_tokens_and_the_earliest_of_several_stop_strings():
    stops = StopStrings(ByteTokenizer())
    early = sequence([5, 6, 7, 5, 6], stop=["<5>"], min_tokens=3)
    both = sequence([9, 8, 7], stop=["<7>", "<8>"])
    stops.add(early)
    stops.add(both)
    hits = dict((s.seq_id, i - s.num_prompt_tokens) for s, i in stops.check())
    # The first "<5>" came before min_tokens (never checked again, vLLM's rule); the second ends it.
    assert hits == {early.seq_id: 3, both.seq_id: 1}
    assert stops.text(early) == "<5><6><7>" and stops.text(both) == "<9>"


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="stop strings need the engine's tokenizer"):
        StopStrings(None).add(sequence([], stop="x"))
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop=["a", ""])


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_the_engine_ends_samples_at_their_stop_string(num_scheduler_steps):
    _, model = make_pair("llama", seed=3)
    tokenizer = ByteTokenizer()
    prompts = random_prompts([6, 9], seed=2)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_scheduler_steps=num_scheduler_steps)
    free = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5, ignore_eos=True))
    stop = f"{free[0].outputs[1].token_ids[6]}>"  # "N>": completed by the token whose text ends that way
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5, ignore_eos=True, stop=[stop])
    for out, ref in zip(llm.generate(prompts, params), free, strict=True):
        for got, full in zip(out.outputs, ref.outputs, strict=True):
            texts = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
            end = next((i for i, t in enumerate(texts) if stop in t), None)
            if end is None:
                assert got.token_ids == full.token_ids and got.finish_reason == "length"
                continue
            assert got.token_ids == full.token_ids[: end + 1] and got.finish_reason == "stop"
            assert got.text == texts[-1][: texts[-1].index(stop)]
            assert got.logprobs == pytest.approx(full.logprobs[: end + 1], abs=1e-4)
    assert not llm.llm_engine.stop_strings.seqs and not llm.llm_engine.stop_strings.finished
