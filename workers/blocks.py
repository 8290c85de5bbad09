"""The KV block pool: which fixed-size blocks of the paged KV cache each sequence holds (torch-free).

The runner's cache (`workers.kv_cache.PagedKVCache`) stores keys/values in `num_blocks` blocks of
`block_size` token positions; this module only does the bookkeeping, so the scheduler can be tested
with a fake runner:
- a sequence's *block table* is the list of block ids holding its positions 0, 1, 2, … in order;
- blocks are taken one at a time as a sequence grows and given back when it finishes or is preempted;
- prefix caching: a block whose 16 positions are all computed is keyed by a chained hash of the token
  ids up to and including it (`chain_hash`), so a block is only ever reused after exactly the same
  prefix. A new sequence takes every cached block of its longest cached prefix and prefills the rest.
  A block nobody holds any more keeps its key and joins an LRU list; it is reused by hash until the
  pool needs a fresh block, which takes a never-keyed free block first, then evicts the oldest one.

Hand-rolled (not a library): the bookkeeping is a few dictionaries tied to our scheduler's Sequence;
vLLM's and SGLang's block managers are the models, not importable pieces.

The pool keeps a journal of the keys it gains and loses (`journal`, when a routing index is published:
workers.routed), taken by the step thread after each step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from shared.block_keys import BLOCK_SIZE, ROOT, chain_hash

__all__ = ["BLOCK_SIZE", "ROOT", "BlockPool", "chain_hash"]


class BlockPool:
    def __init__(self, num_blocks: int, *, block_size: int = BLOCK_SIZE, prefix_cache: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free = list(range(num_blocks - 1, -1, -1))  # never-keyed blocks; pop() gives the lowest id
        self._lru: OrderedDict[int, None] = OrderedDict()  # keyed blocks nobody holds, oldest first
        self._refs = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found cached
        self.journal: dict[bytes, bool] | None = None  # key -> True keyed / False evicted since taken (None: not kept)

    def take_journal(self) -> dict[bytes, bool]:
        """What keys were gained (True) and lost (False) since the last take; empty when no journal is kept."""
        if not self.journal:
            return {}
        taken, self.journal = self.journal, {}
        return taken

    def cached_keys(self) -> list[bytes]:
        """Every key the cache holds now (a routing index's full snapshot)."""
        return list(self._by_key)

    @property
    def num_free(self) -> int:
        """Blocks a sequence could take now (never-keyed ones plus cached ones nobody holds)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def lookup(self, keys: Seq[bytes]) -> list[int]:
        """Cached blocks of the longest prefix whose block keys are `keys` (no references taken)."""
        if not self.prefix_cache:
            return []
        found = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def hold(self, blocks: Seq[int]) -> None:
        """Take a reference on cached blocks a new sequence reuses."""
        for b in blocks:
            if self._refs[b] == 0:
                self._lru.pop(b)
            self._refs[b] += 1

    def allocate(self) -> int | None:
        """A block for one more sequence position range, or None when the pool is exhausted."""
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            key = self._key_of[block]
            assert key is not None
            del self._by_key[key]
            self._key_of[block] = None
            if self.journal is not None:
                self.journal[key] = False
        else:
            return None
        self._refs[block] = 1
        return block

    def release(self, blocks: Seq[int]) -> None:
        """Give back a sequence's blocks, tail first, so the LRU evicts a prefix's tail before its head."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            assert self._refs[b] >= 0, f"block {b} released twice"
            if self._refs[b] > 0:
                continue
            if self._key_of[b] is not None:
                self._lru[b] = None
            else:
                self._free.append(b)

    def register(self, block: int, key: bytes) -> None:
        """Key a block that became full. If the same prefix is already cached in another block (two
        sequences prefilled it at once), this one stays unkeyed and returns to the free list later."""
        if self.prefix_cache and key not in self._by_key and self._key_of[block] is None:
            self._by_key[key] = block
            self._key_of[block] = key
            if self.journal is not None:
                self.journal[key] = True

    def count_query(self, *, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit
