import pytest

from nonstop.rewards.gsm8k import compute_score, extract_solution

# A GSM8K training answer in the original release format (the model is trained to end the same way).
NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        (NATALIA, "72", 1.0),
        (NATALIA.replace("#### 72", "#### 71"), "72", 0.0),  # answered, wrong: format_score
        ("Natalia sold 72 clips altogether.", "72", 0.0),  # no '#### ': strict finds nothing
        ("The total is 1,234 dollars.\n#### 1,234", "1234", 1.0),  # commas removed
        ("He is 5 dollars short.\n#### -5", "-5", 1.0),
        ("He is 5 dollars short.\n#### -5", "5", 0.0),
        ("Each costs $3.5.\n#### 3.5", "3.5", 1.0),
        ("Each costs $3.50.\n#### 3.50", "3.5", 0.0),  # text comparison, as in verl
        ("First guess:\n#### 10\nChecking again, it is 12.\n#### 12", "12", 1.0),  # the last '#### ' counts
        ("First guess:\n#### 10\nChecking again, it is 12.\n#### 12", "10", 0.0),
        ("####72", "72", 0.0),  # the space after #### is part of the format
        ("#### 72.", "72", 0.0),  # verl keeps the trailing dot, so this is "72." and wrong
        (NATALIA, 72, 1.0),  # an int ground truth still matches
    ],
)
def test_strict(response, ground_truth, expected):
    assert compute_score(response, ground_truth) == expected


def test_format_score_and_score():
    wrong = NATALIA.replace("#### 72", "#### 70")
    assert compute_score(wrong, "72", format_score=0.1) == 0.1
    assert compute_score("no answer at all", "72", format_score=0.1) == 0.0  # nothing extracted: always 0
    assert compute_score(NATALIA, "72", score=2.0) == 2.0


def test_only_the_last_300_characters_are_searched():
    assert compute_score("x" * 1000 + "\n#### 72", "72") == 1.0
    assert compute_score("#### 72\n" + "y" * 300, "72") == 0.0


def test_flexible_takes_the_last_number():
    assert extract_solution("48 + 24 = 72 clips", "flexible") == "72"
    assert compute_score("So she sold 48 + 24 = 72 clips", "72", method="flexible") == 1.0
    assert extract_solution("no digits here", "flexible") is None
    assert extract_solution("about 1,000 people", "flexible") == "1,000"  # verl does not remove commas here
    assert extract_solution("#### 72", "strict") == "72"
    with pytest.raises(ValueError, match="strict"):
        extract_solution("#### 72", "loose")
