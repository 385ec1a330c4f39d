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
