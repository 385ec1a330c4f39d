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
    with pytest.raises(AttributeError, match=r"name='compute_score'.*\['reward'\]"):
        load_custom_reward_fn(path, "compute_score")


def test_not_callable(tmp_path):
    path = write(tmp_path, "compute_score = 3\n")
    with pytest.raises(TypeError, match="is a int, not callable"):
        load_custom_reward_fn(path, "compute_score")


def test_wrong_signature(tmp_path):
    path = write(tmp_path, "def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(TypeError, match="must accept"):
        load_custom_reward_fn(path, "compute_score")
