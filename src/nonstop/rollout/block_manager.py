"""The paged KV cache's bookkeeping: which physical block holds which tokens, who shares it, what can be reused.

Blocks are handed out from a free list and reference-counted, so the n samples of a group can share the prompt's
blocks. Prefix caching (vLLM's automatic prefix caching): every FULL block gets a chained hash,
`hash(previous block's hash, this block's token ids)`, registered when the step that computes its KV is scheduled.
A freed block keeps its hash and contents while it sits in the free list, so a later sequence whose tokens hash the
same takes it back instead of recomputing it; the least recently freed block is the one reused first.
`reset_prefix_cache()` forgets every hash: call it after each weight update, when cached KV is stale.
"""

from __future__ import annotations

from collections import OrderedDict

from nonstop.rollout.sequence import Sequence


def block_hash(prefix_hash: int, token_ids: list[int]) -> int:
    # Python's hash of a tuple of ints is deterministic across runs (no string salting); a collision is caught by the
    # token comparison in `find_cached_prefix`.
    return hash((prefix_hash, tuple(token_ids)))


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        # Bumped by reset_prefix_cache: sequences whose hash chain started earlier stop registering blocks, since
        # their KV was computed with the old weights.
        self.cache_epoch = 0
        # Blocks hashed since the scheduler began building the current step: the step being built writes their last
        # tokens' KV (`begin_step` clears it; `settled_prefix` keeps a decode row off them).
        self.blocks_filling: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding this (block-less) sequence's leading full blocks. Pure: nothing is taken. The last token
        is never a hit, so the step that computes it yields the logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        hits, prefix_hash = [], -1
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            prefix_hash = block_hash(prefix_hash, tokens)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def begin_step(self) -> None:
        """The scheduler starts building a step: blocks hashed before now have their KV written by earlier steps
        (or by one still in flight, which runs first on the same stream)."""
        self.blocks_filling.clear()

    def settled_prefix(self, hits: list[int]) -> list[int]:
        """`hits` up to the first block that the step being built fills. A sequence that would compute only one
        token in this step is a decode row, and a decode-only step writes the new tokens' KV and attends in one
        launch (kernels/rotary_decode.py), so it must not read a slot another row writes in that launch; without
        the block it computes that block's tokens itself, as a prefill row (whose step writes before it reads)."""
        for i, block_id in enumerate(hits):
            if block_id in self.blocks_filling:
                return hits[:i]
        return hits

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.hash, block.token_ids = None, []
        self.hash_to_block_id.clear()
        self.cache_epoch += 1

    def _num_hashable_blocks(self, seq: Sequence, num_computed_tokens: int) -> int:
        """How many of the sequence's leading blocks can have hashes once `num_computed_tokens` tokens have KV: the
        full ones whose values are all known. A block holding a token still being sampled (async scheduling)
        waits: `register_computed` hashes it once the value is known."""
        if not self.enable_prefix_caching or seq.cache_epoch != self.cache_epoch:
            return 0
        B, token_ids, first = self.block_size, seq.token_ids, len(seq.block_hashes)
        last = min(num_computed_tokens, len(token_ids)) // B
        # Pending placeholders only ever form the tail, so a block's values are all known iff its last one is.
        while last > first and token_ids[last * B - 1] < 0:
            last -= 1
        return last

    def can_register(self, seq: Sequence, num_computed_tokens: int) -> bool:
        """Whether `_register_full_blocks(seq, num_computed_tokens)` would hash any block."""
        return self._num_hashable_blocks(seq, num_computed_tokens) > len(seq.block_hashes)

    def _register_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Give a hash to every block that is full once `num_computed_tokens` tokens have KV and whose values are
        all known (`_num_hashable_blocks`)."""
        B, token_ids = self.block_size, seq.token_ids
        for i in range(len(seq.block_hashes), self._num_hashable_blocks(seq, num_computed_tokens)):
            tokens = token_ids[i * B : (i + 1) * B]
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else -1, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block_id:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block_id[h] = block.block_id
                self.blocks_filling.add(block.block_id)

    def register_computed(self, seqs: list[Sequence]) -> None:
        """Hash the blocks that filled up while their last token's value was pending (async scheduling), in order."""
        if not self.enable_prefix_caching:
            return
        B = self.block_size
        for seq in seqs:
            if seq.num_cached_tokens // B > len(seq.block_hashes):
                self._register_full_blocks(seq, seq.num_cached_tokens)

    # -- allocation -------------------------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            # Evicted from the prefix cache: its contents are about to be overwritten.
            del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, []
        block.ref_count = 1
        return block_id

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        assert num_blocks <= self.num_free_blocks
        return [self._take_free_block() for _ in range(num_blocks)]

    def num_free_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> int:
        """Free-list blocks that `allocate(seq, num_new_tokens, cached_block_ids)` would consume."""
        if not cached_block_ids:  # the per-step case: a running sequence needs the blocks past its table
            return max(0, -(-(seq.num_cached_tokens + num_new_tokens) // self.block_size) - len(seq.block_table))
        num_owned = len(cached_block_ids)
        new_blocks = max(0, self.num_blocks_for(num_owned * self.block_size + num_new_tokens) - num_owned)
        # A cache hit on a block nobody holds takes it out of the free list too.
        revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        return new_blocks + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        return self.num_free_blocks_needed(seq, num_new_tokens, cached_block_ids) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> None:
        """Make room for `num_new_tokens` more tokens of KV after the cached ones. `cached_block_ids` (from
        `find_cached_prefix`, block-less sequences only) become the sequence's first blocks."""
        if not seq.block_table:
            seq.cache_epoch = self.cache_epoch
        if cached_block_ids:
            assert not seq.block_table and self.can_allocate(seq, num_new_tokens, cached_block_ids)
            for block_id in cached_block_ids:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_block_ids[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
                seq.block_hashes.append(block.hash)
            seq.num_cached_tokens = len(cached_block_ids) * self.block_size
        end = seq.num_cached_tokens + num_new_tokens
        missing = self.num_blocks_for(end) - len(seq.block_table)
        assert missing <= len(self.free_block_ids)  # can_allocate, checked where it is cheap (the hits are taken)
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())
        if end // self.block_size > len(seq.block_hashes):  # some block fills up in this step
            self._register_full_blocks(seq, end)

    def can_append(self, seq: Sequence) -> bool:
        """Decode: room for one more token."""
        return self.can_allocate(seq, 1)

    def may_append(self, seq: Sequence) -> None:
        self.allocate(seq, 1)

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks go back first, so they are evicted before the prefix blocks other sequences may share.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table, seq.block_hashes, seq.num_cached_tokens = [], [], 0

    def release_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None

    def fork(self, parent: Sequence, child: Sequence, private_block_id: int | None) -> tuple[int, int] | None:
        """Give `child` the parent's KV: full blocks shared (ref counted), the partial last block as the private
        copy `private_block_id`. Returns the (src, dst) block copy the model runner must perform, if any."""
        num_full = parent.num_cached_tokens // self.block_size
        for block_id in parent.block_table[:num_full]:
            self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:num_full]
        child.cache_epoch = parent.cache_epoch
        if private_block_id is None:
            return None
        child.block_table.append(private_block_id)
        return parent.block_table[num_full], private_block_id
