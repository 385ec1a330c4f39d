"""`RewardModel`: a Hugging Face `*ForSequenceClassification` checkpoint scoring (prompt, response) pairs
(`reward_model.enable`, `reward_model.model.path`).

The model runs in the trainer process on the training device (bf16 on CUDA, fp32 on CPU), after generation, in
micro-batches of its own: `reward_model.micro_batch_size_per_gpu` samples, or with `use_dynamic_bsz` at most
`forward_max_token_len_per_gpu` tokens each (balanced as the actor's). Micro-batches are right-padded, so each
sequence's positions and causal attention are those of a forward on it alone; the score is the logit transformers
pools, at the last token that is not `pad_token_id`.

What the model reads: the prompt's chat messages plus `{"role": "assistant", "content": response}` rendered with the
reward model's own chat template (verl's "switch chat template", so the reward model's tokenizer need not be the
policy's); a tokenizer without a chat template reads the decoded prompt and response as one plain text.
`reward_model.max_length` cuts longer inputs from the right.

Neither a size nor a token budget set: the budget is sized from free memory and a micro-batch that runs out of
memory is split and retried, as the actor's (batching/memory_budget.py; `reward_model/micro_batch_token_budget`,
`reward_model/oom_retries`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from nonstop.batching.balancing import fixed_micro_batches, token_budget_micro_batches
from nonstop.batching.memory_budget import MicroBatchBudget, run_micro_batches

BUDGET_KEY = "reward_model.forward_max_token_len_per_gpu"


class RewardModel:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        max_length: int | None = None,
    ):
        """`max_token_len` set: token-budget micro-batches (use_dynamic_bsz); else `micro_batch_size` samples each
        (None = all at once)."""
        self.model, self.tokenizer = model.eval(), tokenizer
        self.micro_batch_size, self.max_token_len, self.max_length = micro_batch_size, max_token_len, max_length
        config = model.config.get_text_config()
        if config.pad_token_id is None:
            # transformers pools at the last non-pad token and refuses batches without a pad id.
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            if pad is None:
                raise ValueError("the reward model's config and tokenizer define neither a pad nor an eos token")
            config.pad_token_id = pad
        self.pad_token_id = config.pad_token_id
        self.device = next(model.parameters()).device
        unset = micro_batch_size is None and max_token_len is None
        self.budget = MicroBatchBudget.for_device("reward_model", BUDGET_KEY, unset, self.device)

    @classmethod
    def from_config(cls, reward_model_cfg: Any, device: torch.device) -> RewardModel:
        """From `reward_model.*`: the checkpoint and tokenizer at `model.path`, num_labels must be 1."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = reward_model_cfg.model.path
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device)
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward_model.model.path={path!r} has num_labels={model.config.num_labels}; a reward model "
                "gives one score per sequence (num_labels=1)"
            )
        model.requires_grad_(False)
        dynamic = reward_model_cfg.use_dynamic_bsz
        return cls(
            model,
            AutoTokenizer.from_pretrained(path),
            micro_batch_size=reward_model_cfg.micro_batch_size_per_gpu,
            max_token_len=reward_model_cfg.forward_max_token_len_per_gpu if dynamic else None,
            max_length=reward_model_cfg.max_length,
        )

    def encode(self, messages: Sequence[dict[str, str]], prompt_text: str, response_text: str) -> list[int]:
        """The token ids the reward model reads for one sample (see the module docstring)."""
        if messages and getattr(self.tokenizer, "chat_template", None):
            chat = [*messages, {"role": "assistant", "content": response_text}]
            text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template holds its specials
        else:
            ids = self.tokenizer(prompt_text + response_text)["input_ids"]
        return list(ids[: self.max_length] if self.max_length else ids)

    @torch.no_grad()
    def score_ids(self, input_ids: Sequence[Sequence[int]]) -> Tensor:
        """`[B]` float32 scores of token-id sequences, in the given order."""
        lengths = [len(x) for x in input_ids]
        scores_B = torch.zeros(len(input_ids), dtype=torch.float32)

        def plan(rows: list[int]) -> list[list[int]]:
            if self.max_token_len is None and not self.budget.auto:
                parts = fixed_micro_batches(len(rows), self.micro_batch_size or max(1, len(rows)))
            else:
                row_lengths = [lengths[i] for i in rows]
                budget = self.budget.budget(row_lengths, self.max_token_len)
                parts = token_budget_micro_batches(row_lengths, budget, key=BUDGET_KEY)
            return [[rows[i] for i in part] for part in parts]

        def run(part: list[int]) -> None:
            width = max(lengths[i] for i in part)
            ids_MT = torch.full((len(part), width), self.pad_token_id, dtype=torch.long)
            mask_MT = torch.zeros((len(part), width), dtype=torch.long)
            for row, i in enumerate(part):
                ids_MT[row, : lengths[i]] = torch.tensor(input_ids[i])
                mask_MT[row, : lengths[i]] = 1
            logits_M1 = self.model(input_ids=ids_MT.to(self.device), attention_mask=mask_MT.to(self.device)).logits
            scores_B[part] = logits_M1[:, 0].float().cpu()

        everything = list(range(len(input_ids)))
        if everything:
            run_micro_batches(plan(everything), run, lambda part: [lengths[i] for i in part], self.budget, plan)
        return scores_B

    def score_texts(self, texts: Sequence[str]) -> Tensor:
        """`[B]` scores of plain texts (tokenized with the tokenizer's special tokens)."""
        return self.score_ids([self.encode([], "", text) for text in texts])
