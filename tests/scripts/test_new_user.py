"""scripts/new_user.py --quick: the verl command line's dropped keys are each named, verl-habit mistakes get their
hint, and every command the docs show is in the script's timed list and loads. The full mode (every command run
and timed) is for a person on a 2-core CPU: `.venv/bin/python scripts/new_user.py`."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "new_user.py"


def test_quick_mode_passes():
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "ok   dropped verl key named once: actor_rollout_ref.rollout.mode" in out
    assert "ok   --key=value means key=value" in out
    assert out.rstrip().endswith("all checks passed")


def test_a_documented_command_missing_from_the_list_fails(tmp_path, monkeypatch):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import new_user
    finally:
        sys.path.remove(str(SCRIPT.parent))
    monkeypatch.setattr(new_user, "COMMANDS", new_user.COMMANDS[1:])
    report = new_user.Report()
    new_user.check_documented_list(report)
    assert report.failures == ["documented command is in this script's list: make demo"]
