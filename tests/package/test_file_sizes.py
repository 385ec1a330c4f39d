"""Every source and test file stays readable at one sitting: at most 500 lines, the step loop at most 300 (issue 25)."""

from __future__ import annotations

from import_graph import ROOT, SRC

LIMIT = 500
LOOP_LIMIT = 300


def line_count(path) -> int:
    return len(path.read_text().splitlines())


def test_no_source_file_is_over_the_limit():
    over = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := line_count(p)) > LIMIT}
    assert over == {}, f"files over {LIMIT} lines: split them by job"


def test_no_test_file_is_over_the_limit():
    tests = ROOT / "tests"
    over = {str(p.relative_to(tests)): n for p in tests.rglob("*.py") if (n := line_count(p)) > LIMIT}
    assert over == {}, f"test files over {LIMIT} lines: split them by topic"


def test_the_step_loop_stays_short():
    loop = SRC / "trainer" / "loop.py"
    assert 100 < line_count(loop) <= LOOP_LIMIT
