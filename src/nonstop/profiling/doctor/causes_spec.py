"""Small decode batches that speculative decoding would shorten (rollout/spec/, docs/engine.md).

Generation time in decode steps of at most `SMALL_BATCH` sequences (`rollout/small_batch_frac` x `timing_s/gen`)
is weight reads for a few tokens. Without speculation the doctor recommends it, costing that time at an assumed
speed-up (no acceptance was measured yet). With it, the run's own numbers decide: a verify round's speed-up over the
plain steps in the drafting range is tokens per verify round x plain step time / verify round time, and what is left
is the plain steps' time there at that speed-up; where the speed-up is at most 1 the drafts do not pay and nothing
is lost (the `auto` rule already keeps plain decoding there).
"""

from __future__ import annotations

from nonstop.config.rollout import SpeculativeConfig
from nonstop.profiling.doctor.causes_overlap import overlap_accounts
from nonstop.profiling.doctor.change import Change
from nonstop.profiling.doctor.finding import CLEAR, FOUND, NO_DATA, Finding, pct
from nonstop.profiling.doctor.run_data import RunData
from nonstop.profiling.metric_names import (
    ROLLOUT_SMALL_BATCH_FRAC,
    SPEC_ACCEPTANCE_RATE,
    SPEC_NUM_PLAIN_STEPS,
    SPEC_NUM_VERIFY_STEPS,
    SPEC_PLAIN_TIME_S,
    SPEC_TOKENS_PER_VERIFY,
    SPEC_VERIFY_TIME_S,
)
from nonstop.profiling.phases import timing_key

GEN = timing_key("gen")
SMALL_BATCH = SpeculativeConfig().disable_by_batch_size  # the drafting range's default, as the engine counts it
METHOD = "actor_rollout_ref.rollout.speculative.method"
# The speed-up assumed for small-batch decode before a run measured its own acceptance: a stated assumption, not a
# measurement (the run with speculation on replaces it with its own).
ASSUMED_SPEEDUP = 1.2


def speculative_decoding(run: RunData) -> Finding:
    f = Finding("speculative_decoding", "small decode batches (speculative decoding)", NO_DATA)
    if overlap_accounts(run):
        f.status = CLEAR
        f.evidence.append(f"trainer.mode={run.cfg('trainer.mode')}: generation overlaps training; see overlap_wait")
        return f
    pairs = [
        (r[GEN], r[ROLLOUT_SMALL_BATCH_FRAC])
        for r in run.steps
        if None not in (r.get(GEN), r.get(ROLLOUT_SMALL_BATCH_FRAC))
    ]
    if not pairs:
        f.missing = [m for m in (GEN, ROLLOUT_SMALL_BATCH_FRAC) if not run.has(m)]
        return f
    small_s = sum(gen * frac for gen, frac in pairs)
    gen_s = run.total(GEN)
    f.evidence.append(
        f"{ROLLOUT_SMALL_BATCH_FRAC}: {pct(small_s / max(gen_s, 1e-9))} of generation time ({small_s:.1f} s) ran at "
        f"most {SMALL_BATCH} sequences, where a decode step costs its weight reads whatever its tokens"
    )
    if run.cfg(METHOD, "off") == "off":
        f.gpu_s_lost = small_s * (1 - 1 / ASSUMED_SPEEDUP) * run.num_gpus
        f.status = FOUND if f.gpu_s_lost > 0 else CLEAR
        f.evidence.append(f"speculative decoding is off; a {ASSUMED_SPEEDUP}x speed-up there is assumed")
        f.changes.append(Change({METHOD: "suffix"}, "drafts from the group's own samples, verified exactly"))
        return f
    if not run.has(SPEC_NUM_VERIFY_STEPS):
        f.status = CLEAR
        f.evidence.append("speculative decoding is on, and no step ran in its drafting range")
        return f
    verify_steps, plain_steps = run.total(SPEC_NUM_VERIFY_STEPS), run.total(SPEC_NUM_PLAIN_STEPS)
    tokens = run.mean(SPEC_TOKENS_PER_VERIFY) or 0.0
    f.evidence.append(
        f"{SPEC_TOKENS_PER_VERIFY} {tokens:.2f}, {SPEC_ACCEPTANCE_RATE} {run.mean(SPEC_ACCEPTANCE_RATE) or 0:.2f} over "
        f"{verify_steps:.0f} verify rounds; {plain_steps:.0f} plain steps in the drafting range"
    )
    plain_s = run.total(SPEC_PLAIN_TIME_S)
    if not verify_steps or not plain_steps or not plain_s:
        f.status = CLEAR
        f.evidence.append(
            "no step verified" if not verify_steps
            else "no plain step in the drafting range was timed" if plain_steps
            else "every drafting-range step verified"
        )  # fmt: skip
        return f
    speedup = tokens * (plain_s / plain_steps) / (run.total(SPEC_VERIFY_TIME_S) / verify_steps)
    f.evidence.append(f"a verify round measured {speedup:.2f}x the tokens per second of a plain step there")
    f.gpu_s_lost = plain_s * max(0.0, 1 - 1 / speedup) * run.num_gpus
    f.status = FOUND if f.gpu_s_lost > 0 else CLEAR
    if f.status == FOUND:
        f.changes.append(
            Change(
                {"actor_rollout_ref.rollout.speculative.draft_rule": "always"},
                "the auto rule left steps plain where verify rounds measured faster",
            )
        )
    return f
