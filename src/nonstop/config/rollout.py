"""`actor_rollout_ref.rollout.*`: nonstop's generation engine (vLLM's option names) and its sampling."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check, check_choice, check_positive_or_none
from .optim import DTYPES
from .spec import option, section

CASCADE_CHOICES = (True, False, "auto")
# `cascade_attention=auto` runs a decode step through the cascade kernels when the shared-prefix reads they skip,
# Σ_tiles (members - 1) × prefix tokens, are at least this share of the step's KV reads (Σ context lengths): below it
# the extra launches and the partials' round trip are not paid back (rollout/cascade.py, `nonstop bench cascade`).
CASCADE_AUTO_MIN_SAVED = 0.25
SPECULATIVE_METHODS = ("off", "suffix")
DRAFT_RULES = ("auto", "always")


def _check_sampling(temperature: float, top_k: int, top_p: float, n: int) -> None:
    check(temperature >= 0, "temperature", temperature, "must be >= 0")
    check(top_k >= -1, "top_k", top_k, "must be >= -1 (-1 or 0 = off)")
    check(0 < top_p <= 1, "top_p", top_p, "must be in (0, 1]")
    check(n >= 1, "n", n, "must be >= 1")


@dataclass
class ValKwargsConfig:
    temperature: float = option(0.0, "Validation sampling temperature (0 = greedy)")
    top_k: int = option(-1, "Validation top-k; -1 = off")
    top_p: float = option(1.0, "Validation top-p")
    n: int = option(1, "Samples per validation prompt")
    do_sample: bool = option(False, "Sample during validation; false = greedy")

    def __post_init__(self):
        _check_sampling(self.temperature, self.top_k, self.top_p, self.n)


@dataclass
class SpeculativeConfig:
    """Exact speculative decoding from the group's own samples (rollout/spec/, docs/engine.md)."""

    method: str = option(
        "off",
        "(nonstop) Speculative decoding: off | suffix (model-free drafts from the request's prompt, its sibling "
        "samples and earlier responses to the same prompt, verified in one forward; samples and log-probs are "
        "exactly those of plain decoding)",
    )
    num_speculative_tokens: int = option(8, "Draft tokens per sequence per verify round")
    disable_by_batch_size: int = option(
        64,
        "Verify only while at most this many sequences run (larger decode batches are compute-bound: a verify round "
        "costs about its tokens there)",
    )
    verify_token_budget: int = option(
        256,
        "(nonstop) Most tokens a verify round computes (rows x (1 + draft tokens), rows counted as their CUDA-graph "
        "bucket): a launch of many rows drafts fewer tokens per row (at least 1), since past the forward's "
        "memory-bound floor each token costs compute; 0 = no cap",
    )
    draft_rule: str = option(
        "auto",
        "(nonstop) auto = verify where the kept tokens and the measured round and step times say a verify launch pays "
        "(never slower than plain decoding); always = verify every launch in range",
    )
    prompt_lookup_max: int = option(16, "Longest suffix of a sequence matched against its group's text")
    prompt_lookup_min: int = option(1, "Shortest suffix match that yields a draft")
    draft_from_other_groups: bool = option(
        True,
        "(nonstop) Also draft from the other prompts' samples running in the same launch, ranked below the row's own "
        "group at equal match lengths (other problems' text shares the phrasing); false = the group's text only",
    )
    suffix_decoding_max_cached_requests: int = option(
        10000,
        "Prompts whose latest responses are kept (least recently used out) to draft from when the prompt returns "
        "(later epochs; kept across weight updates); 0 = none",
    )

    def __post_init__(self):
        check_choice("method", self.method, SPECULATIVE_METHODS)
        check_choice("draft_rule", self.draft_rule, DRAFT_RULES)
        for name in ("num_speculative_tokens", "disable_by_batch_size", "prompt_lookup_max", "prompt_lookup_min"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(self.verify_token_budget >= 0, "verify_token_budget", self.verify_token_budget, "must be >= 0")
        check(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min",
            self.prompt_lookup_min,
            f"must be <= prompt_lookup_max={self.prompt_lookup_max}",
        )
        check(
            self.suffix_decoding_max_cached_requests >= 0,
            "suffix_decoding_max_cached_requests",
            self.suffix_decoding_max_cached_requests,
            "must be >= 0",
        )


@dataclass
class TailConfig:
    """Carry unfinished responses into the next step instead of waiting for the long tail (trainer/sources/carry.py,
    docs/modes.md)."""

    enable: bool = option(
        False,
        "(nonstop) trainer.mode=sync / one_step_off: stop a step's generation at its tail and continue the unfinished "
        "sequences (tokens, log-probs and policy versions kept, KV released) in the next step's generation, with the "
        "new weights; a step trains the groups whose n samples have all finished. Every sample is trained once",
    )
    min_running_frac: float = option(
        0.25,
        "(nonstop) The tail: generation stops once fewer than this share of the phase's peak decode batch still runs "
        "(or, trainer.mode=sync, once data.train_batch_size groups are done, whichever comes first); 0 = sync stops "
        "only when the batch's groups are done, one_step_off never stops early",
    )
    max_staleness: int = option(
        1,
        "(nonstop) trainer.mode=sync: most weight versions a sequence is carried across; one that reached it is "
        "finished first at the next step (never dropped). 0 = no carry (plain sync). one_step_off's bound is 1",
    )

    def __post_init__(self):
        check(0 <= self.min_running_frac < 1, "min_running_frac", self.min_running_frac, "must be in [0, 1)")
        check(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")


@dataclass
class RolloutConfig:
    n: int = option(1, "Responses sampled per prompt (the GRPO group size)")
    temperature: float = option(1.0, "Sampling temperature")
    top_k: int = option(-1, "Top-k sampling; -1 = off")
    top_p: float = option(1.0, "Top-p (nucleus) sampling")
    do_sample: bool = option(True, "Sample; false = greedy")
    ignore_eos: bool = option(False, "Keep generating past EOS up to data.max_response_length")
    gpu_memory_utilization: float = option(
        0.5,
        "Fraction of GPU memory the engine may fill (weights + KV cache) while generating; the KV cache never "
        "exceeds what max_num_seqs sequences of max_model_len tokens use",
    )
    dtype: str = option("bfloat16", "Dtype of the engine's weights and KV cache")
    max_num_seqs: int = option(256, "Most sequences decoded together")
    max_num_batched_tokens: int = option(8192, "Most tokens in one engine step (prefill chunk + decodes)")
    max_model_len: int | None = option(None, "Longest sequence the engine holds; null = prompt + response length")
    enable_chunked_prefill: bool = option(
        True,
        "Split long prefills across engine steps; false = each prompt in one step (needs max_num_batched_tokens >= "
        "max_model_len)",
    )
    enable_prefix_caching: bool = option(True, "Reuse KV blocks of shared prompt prefixes (reset after weight updates)")
    enforce_eager: bool = option(False, "Decode without CUDA graphs")
    cudagraph_capture_sizes: list[int] | None = option(
        None,
        "Decode batch sizes captured as CUDA graphs (a batch runs the smallest size >= it; larger batches decode "
        "eagerly); null = 1, 2, 4, 8, then multiples of 16 up to max_num_seqs",
    )
    num_scheduler_steps: int | None = option(
        None,
        "(nonstop) Decode steps chained on the device per engine step when only decoding (same outputs as 1); "
        "null = 8 on CUDA, 1 on CPU (docs/architecture.md)",
    )
    cascade_attention: bool | str = option(
        False,
        "(nonstop) Shared-prefix decode attention: the KV blocks a GRPO group's samples share (their prompt) are read "
        "once per decode step for the whole group instead of once per sample. auto = on the steps where that skips "
        f">= {CASCADE_AUTO_MIN_SAVED:.0%} of the step's KV reads (docs/architecture.md)",
    )
    update_weights_bucket_megabytes: int = option(
        512, "trainer.placement=split: size of each weight broadcast from the trainer to the rollout ranks (MiB)"
    )
    free_cache_engine: bool = option(
        True,
        "Release the KV cache while training (sync mode), resume after; from the second step a cache of at most 5% of "
        "the GPU stays when the update's measured peak plus the cache is under 80% of it",
    )
    log_prob_micro_batch_size_per_gpu: int | None = option(
        None, "Samples per old-log-prob forward on one GPU; null = actor's ppo_micro_batch_size_per_gpu"
    )
    log_prob_use_dynamic_bsz: bool | None = option(None, "Token-budget micro-batches; null = actor's use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = option(
        None, "Token budget per micro-batch; null = actor's ppo_max_token_len_per_gpu"
    )
    speculative: SpeculativeConfig = section(SpeculativeConfig, "(nonstop) Speculative decoding")
    tail: TailConfig = section(TailConfig, "(nonstop) Carry unfinished responses into the next step")
    val_kwargs: ValKwargsConfig = section(ValKwargsConfig, "Sampling for validation")

    def __post_init__(self):
        _check_sampling(self.temperature, self.top_k, self.top_p, self.n)
        check(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )
        check_choice("dtype", self.dtype, DTYPES)
        check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")
        check_positive_or_none("max_model_len", self.max_model_len)
        check_positive_or_none("num_scheduler_steps", self.num_scheduler_steps)
        check_choice("cascade_attention", self.cascade_attention, CASCADE_CHOICES)
        check(
            self.update_weights_bucket_megabytes >= 1,
            "update_weights_bucket_megabytes",
            self.update_weights_bucket_megabytes,
            "must be >= 1",
        )
        sizes = self.cudagraph_capture_sizes
        check(sizes is None or all(s >= 1 for s in sizes), "cudagraph_capture_sizes", sizes, "sizes must be >= 1")
        check_positive_or_none("log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu)
        check_positive_or_none("log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu)
