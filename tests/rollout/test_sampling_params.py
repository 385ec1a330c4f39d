import pytest

from nonstop.rollout import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_invalid_values_name_the_field_and_value(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert str(list(kwargs.values())[0]) in str(info.value)


def test_defaults_and_switches():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, -1, 16)
    assert SamplingParams(temperature=0).greedy and not p.greedy
    assert SamplingParams(top_k=0).top_k == 0  # 0 is accepted as "off", like -1
