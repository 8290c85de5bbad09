"""The KV block pool: allocation, release, prefix keys, LRU eviction of cached blocks."""

from __future__ import annotations

from workers.blocks import ROOT, BlockPool, chain_hash


def keys_of(tokens: list[int], size: int = 16) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // size):
        out.append(chain_hash(out[-1] if out else ROOT, tokens[i * size : (i + 1) * size]))
    return out


def test_blocks_are_handed_out_until_the_pool_is_empty_and_come_back_on_release() -> None:
    pool = BlockPool(3)
    taken = [pool.allocate() for _ in range(3)]
    assert sorted(b for b in taken if b is not None) == [0, 1, 2]
    assert pool.allocate() is None and pool.num_free == 0 and pool.num_used == 3
    pool.release([b for b in taken if b is not None])
    assert pool.num_free == 3 and pool.num_used == 0


def test_a_key_depends_on_the_whole_prefix_not_only_the_block() -> None:
    same_block = list(range(16))
    assert keys_of([*range(100, 116), *same_block])[1] != keys_of([*range(200, 216), *same_block])[1]
    assert keys_of(list(range(32))) == keys_of(list(range(32)))


def test_lookup_returns_the_longest_cached_prefix_only() -> None:
    pool = BlockPool(8)
    tokens = list(range(48))
    keys = keys_of(tokens)
    blocks = [pool.allocate() for _ in range(3)]
    for block, key in zip(blocks, keys, strict=True):
        assert block is not None
        pool.register(block, key)
    other = keys_of([*range(32), *range(900, 916)])
    assert pool.lookup(other) == blocks[:2]  # shares two blocks, then differs
    assert pool.lookup(keys_of([7] * 16)) == []
    assert BlockPool(8, prefix_cache=False).lookup(keys) == []


def test_released_cached_blocks_are_reused_by_key_until_evicted_oldest_first() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    assert a is not None and b is not None
    key_a, key_b = chain_hash(ROOT, [1] * 16), chain_hash(ROOT, [2] * 16)
    pool.register(a, key_a)
    pool.register(b, key_b)
    pool.release([a])
    pool.release([b])  # b is now the most recently used
    assert pool.num_free == 2 and pool.lookup([key_a]) == [a]
    pool.hold([b])  # reused by a new sequence: no longer evictable
    assert pool.allocate() == a  # the only evictable one
    assert pool.lookup([key_a]) == [] and pool.lookup([key_b]) == [b]
    assert pool.allocate() is None


def test_a_never_keyed_free_block_is_taken_before_a_cached_one_is_evicted() -> None:
    pool = BlockPool(2)
    cached = pool.allocate()
    assert cached is not None
    pool.register(cached, chain_hash(ROOT, [3] * 16))
    pool.release([cached])
    fresh = pool.allocate()
    assert fresh is not None and fresh != cached
    assert pool.lookup([chain_hash(ROOT, [3] * 16)]) == [cached]


def test_a_duplicate_prefix_keeps_the_first_block_and_the_second_goes_back_to_the_free_list() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(), pool.allocate()
    assert first is not None and second is not None
    key = chain_hash(ROOT, [5] * 16)
    pool.register(first, key)
    pool.register(second, key)
    pool.release([second])
    pool.release([first])
    assert pool.lookup([key]) == [first]
    assert pool.allocate() == second  # unkeyed, so taken before the cached one is evicted
