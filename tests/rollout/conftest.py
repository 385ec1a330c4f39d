import pytest
from rollout_helpers import make_pair


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_pair(request):
    """(transformers model, nonstop CausalLM) with the same tiny random weights, one per supported family."""
    return make_pair(request.param)
