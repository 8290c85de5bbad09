"""Prefix-cache block keys: the chained hash a worker keys each full KV block by, computed the same way by an
API node that routes a request to the worker holding its prefix (ingest.http.routing).

A block of `block_size` positions is keyed by its parent's key, its token ids and a salt (`chain_hash`), so a
key names the whole prefix up to the block's end: equal keys mean equal prefixes. The first block's parent is
ROOT, or a request's cache salt's own root (`salted_root`), so salted requests share blocks only with their salt.
A routing index holds a key's first INDEX_BYTES bytes (`index_key`): a collision there costs one misrouted
request, never a wrong key/value read (the worker's own cache compares the whole 16 bytes).

Hand-rolled (not a library): vLLM's and SGLang's block hashes are the model; ours must match our scheduler's
keys exactly. BLAKE2b over the token bytes (not Python's `hash`): one client cannot craft a prompt whose block
collides with another client's prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_SIZE = 16  # token positions per KV block (the paged cache's and the prefix cache's unit)
ROOT = b""  # the key "before" the first block
INDEX_BYTES = 8  # of a key, what a routing index holds (shared.keys.kv_index)


def chain_hash(parent: bytes, tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """Key of a full block: its parent's key, its token ids, and whatever else changes the keys/values
    (`salt`: how its tokens were computed, a LoRA adapter later)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def salted_root(salt: str) -> bytes:
    """The key "before" a request's first block: ROOT, or one of the salt's own (ingest.parsers.cache_salt), so no
    block of a salted request ever matches a block of another salt."""
    return chain_hash(ROOT, (), b"cache salt\n" + salt.encode()) if salt else ROOT


def prompt_keys(tokens: Sequence[int], *, cache_salt: str = "", block_size: int = BLOCK_SIZE, limit: int | None = None) -> list[bytes]:
    """Keys of the prompt's blocks a worker could take from its cache: the full blocks before the last prompt
    token (which a worker always computes), at most `limit` of them."""
    usable = max(0, (len(tokens) - 1) // block_size)
    if limit is not None:
        usable = min(usable, limit)
    out: list[bytes] = []
    parent = salted_root(cache_salt)
    for i in range(usable):
        parent = chain_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def index_key(key: bytes) -> bytes:
    return key[:INDEX_BYTES]
