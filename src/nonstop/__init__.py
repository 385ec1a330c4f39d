"""nonstop: reinforcement-learning post-training of LLMs where the GPU never waits."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # `from nonstop import LLM` in vLLM's shape, without importing torch and transformers for `nonstop --help`.
    if name in __all__:
        from nonstop import rollout

        return getattr(rollout, name)
    raise AttributeError(f"module 'nonstop' has no attribute {name!r}")
