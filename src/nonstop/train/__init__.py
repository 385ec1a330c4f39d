"""The actor update's building blocks: micro-batch balancing, packing (plain and prefix-grouped), chunked log-probs
and entropy."""

from nonstop.train.balancing import (
    balance_across_ranks,
    balanced_partitions,
    fixed_micro_batches,
    greedy_partition,
    karmarkar_karp,
    split_to_count,
    token_budget_micro_batches,
)
from nonstop.train.logprob import chunked_logprobs_and_entropy, full_logprobs_and_entropy
from nonstop.train.packing import PackedBatch, pack_sequences, response_logprobs
from nonstop.train.prefix_grouping import (
    PrefixGroupedBatch,
    group_by_prompt,
    grouped_tokens,
    pack_prefix_groups,
    prefix_grouped_micro_batches,
    prefix_saved_fraction,
)

__all__ = [
    "PackedBatch",
    "PrefixGroupedBatch",
    "balance_across_ranks",
    "balanced_partitions",
    "chunked_logprobs_and_entropy",
    "fixed_micro_batches",
    "full_logprobs_and_entropy",
    "greedy_partition",
    "group_by_prompt",
    "grouped_tokens",
    "karmarkar_karp",
    "pack_prefix_groups",
    "pack_sequences",
    "prefix_grouped_micro_batches",
    "prefix_saved_fraction",
    "response_logprobs",
    "split_to_count",
    "token_budget_micro_batches",
]
