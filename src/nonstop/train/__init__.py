"""The actor update's building blocks: micro-batch balancing, packing, chunked log-probs and entropy."""

from nonstop.train.balancing import (
    balance_across_ranks,
    balanced_partitions,
    fixed_micro_batches,
    greedy_partition,
    karmarkar_karp,
    token_budget_micro_batches,
)
from nonstop.train.logprob import chunked_logprobs_and_entropy, full_logprobs_and_entropy
from nonstop.train.packing import PackedBatch, pack_sequences, response_logprobs

__all__ = [
    "PackedBatch",
    "balance_across_ranks",
    "balanced_partitions",
    "chunked_logprobs_and_entropy",
    "fixed_micro_batches",
    "full_logprobs_and_entropy",
    "greedy_partition",
    "karmarkar_karp",
    "pack_sequences",
    "response_logprobs",
    "token_budget_micro_batches",
]
