from nonstop.rollout.block_manager import BlockManager
from nonstop.rollout.sampling_params import SamplingParams
from nonstop.rollout.sequence import Sequence


def seq(tokens: list[int], n: int = 1) -> Sequence:
    return Sequence("r", tokens, SamplingParams(n=n), seed=0, num_samples=n)


def test_allocate_in_chunks_and_deallocate_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    bm.allocate(s, 6)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    s.num_cached_tokens = 6
    bm.allocate(s, 4)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_cached_tokens = 10
    assert bm.can_append(s)
    bm.deallocate(s)
    assert bm.num_free_blocks == 8 and s.block_table == [] and s.num_cached_tokens == 0


def test_prefix_cache_reuses_full_blocks_by_chained_hash_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a, 9)
    # Same first block, different second block: only the first is a hit (the hash chains through block 0).
    b = seq([1, 2, 3, 4, 5, 6, 7, 0, 9, 9])
    assert bm.find_cached_prefix(b) == a.block_table[:1]
    # Identical tokens: both full blocks hit; the partial third block never does.
    c = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits = bm.find_cached_prefix(c)
    assert hits == a.block_table[:2]
    bm.allocate(c, 1, hits)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    # Same blocks at a different offset do not hit: the chain starts from a different prefix.
    assert bm.find_cached_prefix(seq([5, 6, 7, 8, 1, 2, 3, 4, 0])) == []


def test_whole_prompt_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)))
    bm.allocate(a, 8)
    # 8 tokens = 2 full blocks, but the last token must be computed to get logits: only block 0 may hit.
    assert bm.find_cached_prefix(seq(list(range(8)))) == a.block_table[:1]


def test_freed_blocks_stay_cached_until_evicted_and_reset_forgets_them():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = seq([1, 2, 3, 4, 5])
    hits = bm.find_cached_prefix(b)
    assert hits == table[:2]
    # Reviving a free cached block consumes it from the free list.
    assert bm.num_free_blocks_needed(b, 1, hits) == 3
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])) == []


def test_eviction_drops_the_hash():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq([1, 2, 3])
    bm.allocate(a, 3)
    bm.deallocate(a)
    other = seq([7, 7, 7, 7])
    bm.allocate(other, 4)  # takes both free blocks, overwriting the cached ones
    bm.deallocate(other)
    assert bm.find_cached_prefix(seq([1, 2, 3])) == []


def test_sequences_started_before_a_reset_do_not_register_stale_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3, 4, 5, 6])
    bm.allocate(a, 3)
    a.num_cached_tokens = 3
    bm.reset_prefix_cache()
    bm.allocate(a, 3)  # its block 1 becomes full now, but its KV mixes old-weight tokens
    assert bm.hash_to_block_id == {}


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(list(range(6)), n=3)
    bm.allocate(parent, 6)
    parent.num_cached_tokens = 6
    private = bm.allocate_blocks(2)
    children = [parent.fork(i) for i in (1, 2)]
    copies = [bm.fork(parent, c, p) for c, p in zip(children, private, strict=True)]
    assert copies == [(parent.block_table[1], private[0]), (parent.block_table[1], private[1])]
    assert bm.blocks[parent.block_table[0]].ref_count == 3
    assert bm.blocks[parent.block_table[1]].ref_count == 1
    for s in [parent, *children]:
        bm.deallocate(s)
    assert bm.num_free_blocks == 8
