"""`nonstop doctor`: text and JSON reports exit 0; an unreadable run directory is one line on stderr, exit 2."""

import json

from run_helpers import write_run

from nonstop.cli import main


def test_doctor_text_and_json(tmp_path, capsys):
    run = write_run(tmp_path, metrics={"timing_s/reward": 6.0})
    assert main(["doctor", str(run)]) == 0
    out = capsys.readouterr().out
    assert " 1. reward scoring on the critical path: 30.0 GPU-s" in out
    assert "change:   trainer.mode=one_step_off  (the next step generates" in out
    assert "note:     the pool's own numbers explain 0.05 s of the 6.00 s wait on 4 workers" in out
    assert main(["doctor", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["causes"][0]["cause"] == "reward_on_critical_path" and report["num_steps"] == 5
    assert report["device"] == "cuda"
    assert report["causes"][0]["changes"][0]["overrides"] == {"trainer.mode": "one_step_off"}


def test_doctor_unreadable_run_dir_is_one_line_exit_2(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nonstop doctor: error:") and "no metrics.jsonl" in err and err.count("\n") == 1
