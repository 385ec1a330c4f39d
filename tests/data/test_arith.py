"""The built-in `nonstop/arith` task: deterministic from its seed, train and test disjoint, answers right, scorer
per its documented rule."""

import pytest

from nonstop.data.arith import DATA_SOURCE, PROMPT, all_problems, arith_rows
from nonstop.rewards.arith import score_arith


def test_same_seed_same_rows_other_seed_other_rows():
    assert [r.to_verl() for r in arith_rows("train", seed=3)] == [r.to_verl() for r in arith_rows("train", seed=3)]
    assert [r.prompt for r in arith_rows("train", seed=3)] != [r.prompt for r in arith_rows("train", seed=4)]
    assert [r.prompt for r in arith_rows("train", 10)] == [r.prompt for r in arith_rows("train", 30)[:10]]


@pytest.mark.parametrize("max_operand", [5, 20])
def test_splits_partition_all_problems(max_operand):
    train = {r.extra_info["question"] for r in arith_rows("train", max_operand=max_operand)}
    test = {r.extra_info["question"] for r in arith_rows("test", max_operand=max_operand)}
    assert not train & test
    assert train | test == {question for question, _ in all_problems(max_operand)}
    assert len(test) == round(0.2 * (len(train) + len(test)))


def test_rows_are_verl_rows_with_correct_answers():
    rows = arith_rows("test", seed=1, max_operand=20)
    assert len({r.uid for r in rows}) == len(rows) == 134  # 441 sums + 231 differences, a fifth held out
    for index, row in enumerate(rows):
        assert row.data_source == DATA_SOURCE and row.split == "test" and row.index == index
        assert row.prompt == [{"role": "user", "content": PROMPT.format(question=row.extra_info["question"])}]
        a, op, b = row.extra_info["question"].split()
        a, b = int(a), int(b)
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert int(row.ground_truth) == (a + b if op == "+" else a - b) >= 0
    assert {r.extra_info["question"].split()[1] for r in rows} == {"+", "-"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        arith_rows("val")
    with pytest.raises(ValueError, match=r"train split has 124 problems at max_operand=9; size must be in \[1, 124\]"):
        arith_rows("train", 125, max_operand=9)


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("12", "12", 1.0),
        (" 12.", "12", 1.0),
        ("5 + 7 = 12", "12", 1.0),  # the last integer counts
        ("The answer is 12", 12, 1.0),
        ("12 is wrong, it is 13", "12", 0.0),
        ("13", "12", 0.1),  # the requested bare-number format, wrong value
        ("5 + 7 = 13", "12", 0.0),
        ("I don't know.", "12", 0.0),
        ("", "0", 0.0),
        ("-3", "-3", 1.0),
        ("10 - 10 = 0", "0", 1.0),
        ("007", "7", 1.0),
    ],
)
def test_score_arith(response, truth, score):
    assert score_arith(response, truth) == score


def test_the_registry_scores_the_task_by_its_data_source():
    """The data source the rows carry is the one the built-in scorer is registered under."""
    from nonstop.rewards import default_compute_score

    row = arith_rows("train", size=1)[0]
    assert default_compute_score(row.data_source, f"= {row.ground_truth}", row.ground_truth) == 1.0
    assert default_compute_score(DATA_SOURCE, "x", row.ground_truth) == 0.0
