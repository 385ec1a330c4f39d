import pickle

import pytest

from nonstop.rewards import load_custom_reward_fn


def write(tmp_path, source, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_loads_path_and_function(tmp_path):
    path = write(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return {'score': float(ground_truth in solution_str), 'source': data_source}\n",
    )
    fn = load_custom_reward_fn(path, "compute_score")
    args = dict(data_source="d", solution_str="it is 7", ground_truth="7", extra_info=None)
    assert fn(**args) == {"score": 1.0, "source": "d"}
    # Workers receive (path, name) and load the file again.
    again = pickle.loads(pickle.dumps(fn))
    assert again.path == fn.path and again(**args) == {"score": 1.0, "source": "d"}


def test_async_function(tmp_path):
    path = write(
        tmp_path, "async def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n"
    )
    assert load_custom_reward_fn(path, "score")(data_source="", solution_str="", ground_truth="") == 0.25


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path=.*nope.py"):
        load_custom_reward_fn(str(tmp_path / "nope.py"), "compute_score")


def test_missing_function_lists_what_is_there(tmp_path):
    path = write(tmp_path, "def reward(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"name='compute_score'.*\['reward'\]"):
        load_custom_reward_fn(path, "compute_score")


def test_not_callable(tmp_path):
    path = write(tmp_path, "compute_score = 3\n")
    with pytest.raises(ValueError, match="is a int, not callable"):
        load_custom_reward_fn(path, "compute_score")


def test_wrong_signature(tmp_path):
    path = write(tmp_path, "def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(ValueError, match="must accept"):
        load_custom_reward_fn(path, "compute_score")


def test_reward_kwargs_reach_the_function_in_a_worker_process(tmp_path):
    from nonstop.config import load_config
    from nonstop.rewards import RewardPool

    path = tmp_path / "scale.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    return scale * float(solution_str == ground_truth)\n"
    )
    config = load_config(
        None,
        [f"custom_reward_function.path={path}", "+custom_reward_function.reward_kwargs.scale=0.5"],
    )
    with RewardPool.from_config(config.reward_model, config.custom_reward_function) as pool:
        pool.submit("a", "src", "7", "7", {})
        pool.submit("b", "src", "8", "7", {})
        results = pool.collect(["a", "b"])
    assert results["a"].score == 0.5 and results["b"].score == 0.0


def test_reward_kwargs_the_function_does_not_take_fail_at_load(tmp_path):
    from nonstop.rewards.custom import load_custom_reward_fn

    path = tmp_path / "plain.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(ValueError, match="reward_kwargs by keyword"):
        load_custom_reward_fn(str(path), "compute_score", {"scale": 0.5})


def test_a_syntax_error_is_one_line_naming_file_and_line(tmp_path):
    path = write(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n  return (\n")
    with pytest.raises(ValueError) as e:
        load_custom_reward_fn(path, "compute_score")
    assert str(e.value).startswith(f"custom_reward_function.path={path!r}: syntax error at {path}:2:")
    assert "\n" not in str(e.value)


def test_the_trainer_process_never_runs_the_file(tmp_path):
    """Module-level code runs where scoring runs (a worker), not where the function is checked and configured."""
    import os

    from nonstop.rewards import RewardPool

    log = tmp_path / "pids.txt"
    path = write(
        tmp_path,
        f"import os\nopen({str(log)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    )
    fn = load_custom_reward_fn(path, "compute_score")
    with RewardPool(fn, num_workers=1, timeout_s=30.0) as pool:
        pool.submit(0, "user/task", "x", "x")
        assert pool.collect([0])[0].score == 1.0
    pids = log.read_text().split()
    assert pids and str(os.getpid()) not in pids


def test_a_file_that_raises_when_run_stops_the_run_with_its_line(tmp_path):
    from nonstop.rewards import RewardPool, RewardSetupError

    path = write(
        tmp_path,
        "import os\nTABLE = os.environ['NO_SUCH_VARIABLE']\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    )
    fn = load_custom_reward_fn(path, "compute_score")  # parsed only: nothing raised yet
    with pytest.raises(RewardSetupError, match=r"running the file failed \(line 2\): KeyError: 'NO_SUCH_VARIABLE'"):
        fn(data_source="", solution_str="", ground_truth="")
    with RewardPool(fn, num_workers=1, timeout_s=30.0) as pool:
        pool.submit(0, "user/task", "x", "x")
        with pytest.raises(RewardSetupError, match=r"could not load the scoring function: .*line 2.*KeyError"):
            pool.collect([0])


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def compute_score(*, data_source, solution_str, ground_truth, extra_info, **kw):\n    return 1\n", None),
        ("def compute_score(**kwargs):\n    return 1\n", None),
        ("def compute_score(x=0, /, data_source='', solution_str='', ground_truth='', extra_info=None): pass", None),
        ("def compute_score(a, /, data_source, solution_str, ground_truth, extra_info=None):\n  return 1\n", "'a'"),
        ("def compute_score(data_source, solution_str, ground_truth, extra_info, *, flag):\n    return 1\n", "'flag'"),
        ("def compute_score(data_source, solution_str):\n    return 1\n", "'ground_truth'"),
        ("if True:\n    def compute_score(**kw):\n        return 1\n", None),
        ("from math import *\n", None),
        ("from math import sqrt as compute_score\n", None),
        ("compute_score = [1, 2]\n", "is a list, not callable"),
    ],
)
def test_signature_checked_from_the_source(tmp_path, source, message):
    path = write(tmp_path, source)
    if message is None:
        load_custom_reward_fn(path, "compute_score")
    else:
        with pytest.raises(ValueError, match=message):
            load_custom_reward_fn(path, "compute_score")
