"""The paged KV cache: one pool of fixed-size blocks per layer, read through each sequence's block table.

Layout: per layer, a keys and a values tensor of [num_blocks + 1, kv_heads, block_size, head_dim] —
block-major, and head-major inside a block, so one (block, head) pair is a dense [block_size,
head_dim] tile. A read gathers whole tiles (one index per block and head, `read_index`), and the
gathered keys of one head of one sequence are a dense [positions, head_dim] matrix that a bmm takes
as it is. (Row-major [rows, kv_heads, head_dim] made every read a gather of 128-byte rows that the
matmuls then copied again into head-major order: 6 ms of a layer's 8 at 32 sequences × 800 keys.)

The last block is the zeroed padding block: a read past a sequence's last block reads it, masked out.
A sequence's own last block is read whole too, its unwritten tail masked out; every block is zeroed
when its first position is written (`fresh_blocks`), so that tail is zeros, never the NaN bit
patterns of untouched memory (0 × NaN would leak through the masked softmax) nor another
sequence's keys. The pool is `torch.empty`: pages are only touched (and only then resident) when a
block is first written, so a large default budget costs no memory until load needs it. Which blocks a
sequence holds is decided by the torch-free `workers.blocks.BlockPool`.

`PagedKVCache` plugs into any transformers decoder through the `Cache` interface (the HF path): each
layer's `update` scatters the new keys/values into their rows, then gathers every sequence's blocks
into the [B, kv_heads, kv_len, head_dim] tensors its attention wants, cut to kv_len = the longest
row's keys; the prepared 4-D mask gives each row its own length. (Not whole blocks: torch's CPU SDPA
is not row-invariant in the query count once masked padding keys are appended, so a prompt whose
prefix was cached — fewer queries in its last chunk — got other bf16 logits than the same prompt
computed whole, and `met replay` diverged; with the exact length it gives the same ones.) The lean
path (`workers.llama`, one flattened forward per step) uses the same pools and index helpers directly, without `bind`/`update`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers.cache_utils import Cache

log = logging.getLogger(__name__)
CPU_SHARE = 0.4  # of the memory available at start, for the default pool (touched only as it fills)
GPU_SHARE = 0.8  # of the device memory free after the weights


@dataclass(frozen=True, slots=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype) -> KVGeometry:
        """From a transformers model config."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, dtype)

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


def default_budget_mb(device: torch.device, *, sharers: int = 1) -> int:
    """`--kv-budget-mb 0`: a share of the memory free now (after the weights are loaded). On a CPU the share
    is split among the `sharers` workers `met serve --workers N` starts on this machine (each would
    otherwise take the whole share of the same memory: 3 x 8.7 GB on a 24 GB machine, session 21), and
    taken of what this process's memory cgroup still allows (`available_bytes`)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * GPU_SHARE) // 2**20
    return int(available_bytes() * CPU_SHARE / max(1, sharers)) // 2**20


CGROUP = Path("/sys/fs/cgroup")
# (limit, usage, stat file, its reclaimable page-cache line) of cgroup v2, then v1's memory controller
CGROUP_FILES = (("memory.max", "memory.current", "memory.stat", "inactive_file"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"))
UNLIMITED = 2**62  # v1 writes "no limit" as a page-rounded 2**63 - 1


def available_bytes(cgroup: Path = CGROUP) -> int:
    """The memory this process can still take: the machine's available memory, or less where its memory
    cgroup's limit (`docker run --memory`, a compose or Kubernetes limit) leaves less — the limit minus the
    cgroup's usage, its inactive page cache counted as free. psutil reads /proc/meminfo, which in a
    container is the host's: a worker under a 4 GiB limit on a 64 GiB host would plan a 25 GiB pool and be
    killed as it filled."""
    available = int(psutil.virtual_memory().available)
    for limit_file, usage_file, stat_file, reclaimable in CGROUP_FILES:
        try:
            limit_text = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= UNLIMITED:
            return available
        try:
            stat = dict(line.split(maxsplit=1) for line in (cgroup / stat_file).read_text().splitlines() if " " in line)
            inactive = int(stat.get(reclaimable, 0))
        except (OSError, ValueError):
            inactive = 0
        return min(available, max(0, int(limit_text) - usage + inactive))
    return available


def block_tables(tables: list[list[int]], ends: list[int], *, width: int, block_size: int, pad_block: int) -> torch.Tensor:
    """[len(tables), width] blocks of key positions 0..width * block_size - 1 by each block table (CPU);
    the padding block past the block that holds each table's last position (`ends`: its key count)."""
    used = [-(-end // block_size) for end in ends]
    return torch.tensor([t[:u] + [pad_block] * (width - u) for t, u in zip(tables, used, strict=True)], dtype=torch.long)


def write_index(rows: torch.Tensor, *, kv_heads: int, block_size: int) -> torch.Tensor:
    """rows: [...] pool rows (block * block_size + offset) → [..., kv_heads] rows of the pool viewed as
    [(num_blocks + 1) * kv_heads * block_size, head_dim], one per kv head."""
    block, offset = rows.div(block_size, rounding_mode="floor"), rows.remainder(block_size)
    heads = torch.arange(kv_heads, device=rows.device)
    return ((block[..., None] * kv_heads + heads) * block_size + offset[..., None]).reshape(*rows.shape, kv_heads)


def fresh_blocks(rows: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """The blocks whose first position is among `rows` [N]: written for the first time, to be zeroed first."""
    return rows[rows.remainder(block_size) == 0].div(block_size, rounding_mode="floor")


def read_index(tables: torch.Tensor, *, kv_heads: int) -> torch.Tensor:
    """tables: [S, W] blocks of S sequences → the flat index of their (block, head) tiles in the pool
    viewed as [(num_blocks + 1) * kv_heads, block_size, head_dim], ordered (sequence, kv head, block):
    gathered, it views as [S, kv_heads, W * block_size, head_dim], one dense matrix per sequence and head."""
    heads = torch.arange(kv_heads, device=tables.device)
    return (tables[:, None, :] * kv_heads + heads[:, None]).reshape(-1)  # [S * kv_heads * W]


def gather(pool: torch.Tensor, index: torch.Tensor, pieces: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The tiles of `index` — the `read_index`es of several pieces, concatenated; `pieces`: each one's
    (sequences, blocks) — in one gather, as each piece's [sequences, kv_heads, blocks * block_size, head_dim]."""
    _blocks, kv_heads, block_size, dim = pool.shape
    tiles = pool.view(-1, block_size, dim).index_select(0, index)
    parts = tiles.split([s * kv_heads * w for s, w in pieces]) if len(pieces) > 1 else (tiles,)
    return [part.view(s, kv_heads, w * block_size, dim) for part, (s, w) in zip(parts, pieces, strict=True)]


class PagedKVCache(Cache):
    """Block-pool KV buffers behind transformers' `Cache.update`. `bind()` says what a forward writes and reads."""

    def __init__(self, geometry: KVGeometry, *, num_blocks: int, block_size: int, device: torch.device) -> None:
        super().__init__(layers=[])
        self.pad_block = num_blocks  # the zeroed block past the pool (see the module docstring)
        shape = (num_blocks + 1, geometry.kv_heads, block_size, geometry.head_dim)
        self.keys = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        self.values = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        for buf in (*self.keys, *self.values):
            buf[self.pad_block].zero_()
        self.block_size = block_size
        self._write = torch.zeros(0, 0, dtype=torch.long, device=device)
        self._fresh = torch.zeros(0, dtype=torch.long, device=device)
        self._read = torch.zeros(0, 0, dtype=torch.long, device=device)
        self._read_index = torch.zeros(0, dtype=torch.long, device=device)
        self._kv_len = 0

    def tables(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """[B, W] blocks of each sequence, W the blocks of the longest (`block_tables`)."""
        width = -(-max(lengths) // self.block_size)
        return block_tables(tables, lengths, width=width, block_size=self.block_size, pad_block=self.pad_block).to(self.keys[0].device)

    def bind(self, write: torch.Tensor, read: torch.Tensor, kv_len: int) -> None:
        """write: [B, T] pool rows of the tokens this forward adds; read: [B, W] blocks attention reads
        (`tables`), of which the first `kv_len` positions (the longest sequence's keys) reach attention."""
        kv_heads = self.keys[0].shape[1]
        self._write = write_index(write, kv_heads=kv_heads, block_size=self.block_size).transpose(1, 2).reshape(-1)  # [B * kv_heads * T]
        self._fresh = fresh_blocks(write.reshape(-1), block_size=self.block_size)
        self._read = read
        self._kv_len = kv_len
        self._read_index = read_index(read, kv_heads=kv_heads)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, kv_heads, T, head_dim] → all keys/values: [B, kv_heads, kv_len, head_dim]
        b, dim = key_states.shape[0], key_states.shape[-1]
        out = []
        for pool, new in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            if self._fresh.numel():
                pool.index_fill_(0, self._fresh, 0)
            pool.view(-1, dim).index_copy_(0, self._write, new.reshape(-1, dim))
            (keys,) = gather(pool, self._read_index, [(b, self._read.shape[1])])
            out.append(keys[:, :, : self._kv_len])
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len
