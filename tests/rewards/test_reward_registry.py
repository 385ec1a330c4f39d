import sys

import pytest

from nonstop.rewards import RewardSetupError, default_compute_score, register_scorer, registry


def test_gsm8k_by_data_source():
    assert default_compute_score("openai/gsm8k", "so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 8", "7", extra_info={"split": "train"}) == 0.0


def test_unknown_data_source_names_it_and_the_known_ones():
    with pytest.raises(RewardSetupError) as info:
        default_compute_score("my/dataset", "#### 7", "7")
    assert "'my/dataset'" in str(info.value)
    assert "openai/gsm8k" in str(info.value) and "HuggingFaceH4/MATH-500" in str(info.value)
    assert "register_scorer" in str(info.value)


def _exact(solution_str, ground_truth):
    return {"score": float(solution_str.strip() == ground_truth), "exact": True}


def test_register_scorer(monkeypatch):
    monkeypatch.setattr(registry, "_SCORERS", dict(registry._SCORERS))
    register_scorer("test/exact", _exact)
    register_scorer("test/exact", _exact)  # re-import of the registering module: no-op
    assert default_compute_score("test/exact", " 12", "12") == {"score": 1.0, "exact": True}
    with pytest.raises(ValueError, match="already has a scorer"):
        register_scorer("test/exact", lambda s, g: 0.0)

    @register_scorer("test/decorated")
    def decorated(solution_str, ground_truth):
        return 0.5

    assert default_compute_score("test/decorated", "", "") == 0.5


def test_math_without_math_verify_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(RewardSetupError, match="pip install math-verify"):
        default_compute_score("HuggingFaceH4/MATH-500", "The answer is $\\frac{1}{2}$", "\\frac{1}{2}")


def test_math_with_math_verify():
    pytest.importorskip("math_verify")
    assert default_compute_score("HuggingFaceH4/MATH-500", "So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5") == 1.0
    assert default_compute_score("lighteval/MATH", "So the answer is $\\boxed{3}$.", "\\frac{1}{2}") == 0.0


def test_builtin_arith_task_is_scored_by_its_generator_rule():
    assert default_compute_score("nonstop/arith", "7 + 3 = 10", "10") == 1.0
    assert default_compute_score("nonstop/arith", "11", "10") == 0.1  # a bare integer, wrong: format credit
    assert default_compute_score("nonstop/arith", "I do not know", "10") == 0.0
