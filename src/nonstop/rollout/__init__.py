"""nonstop's rollout engine: paged KV cache, continuous batching, shared-prompt groups, vLLM's API shape."""

from nonstop.rollout.engine_args import EngineArgs, engine_args
from nonstop.rollout.llm import LLM
from nonstop.rollout.llm_engine import LLMEngine
from nonstop.rollout.outputs import CompletionOutput, RequestOutput
from nonstop.rollout.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams", "engine_args"]
