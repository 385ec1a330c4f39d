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


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("nonstop 0.1.0 (torch ")


def test_flag_spelled_overrides_mean_the_same_as_key_value(capsys):
    assert main(["config", "show", "data.train_batch_size=512", "trainer.test_freq=3"]) == 0
    plain = capsys.readouterr().out
    assert main(["config", "show", "--data.train_batch_size=512", "--trainer.test_freq", "3"]) == 0
    assert capsys.readouterr().out == plain


def test_an_override_typed_as_an_option_gets_a_hint(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--learning_rate", "1e-5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --learning_rate" in err and "overrides are key=value without dashes" in err


def test_config_show_prints_a_note_per_dropped_verl_key(capsys):
    items = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async"]
    assert main(["config", "show", *items]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "note: actor_rollout_ref.rollout.name='vllm' is not used by nonstop: nonstop always generates with its own "
        "engine, which takes vLLM's option names",
        "note: actor_rollout_ref.rollout.mode='async' is not used by nonstop: nonstop's engine runs inside the "
        "trainer; to overlap generation with training set trainer.mode=one_step_off or trainer.mode=async",
    ]


def test_config_show_says_once_that_the_carry_over_turned_token_level_is_on(capsys):
    assert main(["config", "show", "actor_rollout_ref.rollout.tail.enable=True"]) == 0
    out, err = capsys.readouterr()
    assert "rollout_is: token" in out
    assert err.splitlines() == [
        "note: algorithm.rollout_correction.rollout_is=token (default with actor_rollout_ref.rollout.tail.enable=True"
        "): carried responses mix tokens of several policy versions, corrected by token-level truncated importance "
        "sampling; algorithm.rollout_correction.rollout_is=null turns it off"
    ]


def test_hydra_delete_is_an_override_not_a_file(capsys):
    assert main(["config", "show", "~trainer.logger", "trainer.test_freq=3"]) == 0
    assert "test_freq: 3" in capsys.readouterr().out


def test_a_key_without_a_value_is_not_read_as_a_file(capsys):
    assert main(["config", "show", "trainer.val_before_train"]) == 2
    err = capsys.readouterr().err
    assert "'trainer.val_before_train' is a config key, not a file: write trainer.val_before_train=VALUE" in err
