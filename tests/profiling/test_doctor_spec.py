"""The doctor's speculative-decoding finding on real CPU runs of the trainer's tiny model: a run of small decode
batches without speculation gets the recommendation; the same run with it applied, where the greedy responses
repeat themselves and drafts are accepted, shows a smaller share of the cause."""

import json
import re

from real_runs import use_engine
from test_doctor_real_runs import real_run

from nonstop.cli import main
from nonstop.rollout import LLM, engine_args

# 4 prompts x 8 greedy samples of 24 tokens: 32 sequences in every decode step, the drafting range's default.
OVERRIDES = ("actor_rollout_ref.rollout.do_sample=False", "data.max_response_length=24")
METHOD = "actor_rollout_ref.rollout.speculative.method"


def config_engine(trainer) -> None:
    """The engine the trainer builds from its config (`engine_args`, as `build_engine` does), on the CPU: the test
    helpers' engine takes fixed arguments instead."""
    args = {**vars(engine_args(trainer.config)), "num_kv_blocks": 256}
    use_engine(trainer, LLM(trainer.model, tokenizer=trainer.tokenizer, device="cpu", **args))


def evidence(finding: dict, pattern: str) -> float:
    """The number `pattern`'s group captures in the finding's evidence."""
    for line in finding["evidence"]:
        if match := re.search(pattern, line):
            return float(match.group(1))
    raise AssertionError(f"no evidence matches {pattern!r}: {finding['evidence']}")


def spec_finding(run_dir, capsys) -> tuple[dict, float]:
    capsys.readouterr()
    assert main(["doctor", str(run_dir), "--json"]) == 0
    finding = next(c for c in json.loads(capsys.readouterr().out)["causes"] if c["cause"] == "speculative_decoding")
    return finding, finding["share"]


def test_applying_speculation_lowers_the_small_batch_share(tmp_path, capsys):
    plain, plain_share = spec_finding(real_run(tmp_path / "plain", OVERRIDES, plant=config_engine), capsys)
    assert plain["status"] == "found" and plain_share > 0
    assert evidence(plain, r"small_batch_frac: (\d+)%") >= 80  # every decode step (the prefill aside)
    (change,) = plain["changes"]
    assert change["overrides"] == {METHOD: "suffix"}

    applied = (*OVERRIDES, f"{METHOD}=suffix", "actor_rollout_ref.rollout.speculative.draft_rule=always")
    spec, spec_share = spec_finding(real_run(tmp_path / "spec", applied, plant=config_engine), capsys)
    assert evidence(spec, r"tokens_per_verify ([\d.]+)") > 1.2  # the repeating responses' drafts are kept
    assert spec_share < plain_share
