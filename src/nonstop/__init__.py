"""nonstop: reinforcement-learning post-training of LLMs where the GPU never waits."""

__version__ = "0.1.0"
