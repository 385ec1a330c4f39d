"""The `nonstop` command: subcommands dispatch, user mistakes print one line naming the bad value (exit 2)."""

import json

import pytest

from nonstop.cli import main
from nonstop.cli.generate import read_requests


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "generate" in capsys.readouterr().out


def test_config_show_prints_resolved_yaml_with_overrides(capsys):
    assert main(["config", "show", "actor_rollout_ref.rollout.n=8", "data.train_batch_size=512"]) == 0
    out = capsys.readouterr().out
    assert "train_batch_size: 512" in out and "n: 8" in out


def test_config_show_unknown_key_suggests_the_closest(capsys):
    assert main(["config", "show", "actor_rollout_ref.rollout.gpu_mem_utilization=0.5"]) == 2
    err = capsys.readouterr().err
    assert "gpu_mem_utilization" in err and "did you mean 'actor_rollout_ref.rollout.gpu_memory_utilization'" in err


def test_config_show_missing_yaml_names_the_file(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    assert main(["config", "show", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_generate_input_rows_are_validated_with_file_and_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    assert read_requests(good) == [{"prompt": "hi"}, {"prompt_token_ids": [1, 2]}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_requests(bad)
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"prompt": "a", "messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"both.jsonl:1: expected exactly one of"):
        read_requests(both)


def test_generate_missing_input_file_is_one_line_error(capsys, tmp_path):
    assert main(["generate", "--input", str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl: no such file" in capsys.readouterr().err
