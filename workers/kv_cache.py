"""The paged KV cache: one pool of fixed-size blocks per layer, read through each sequence's block table.

Layout: per layer, a keys and a values tensor of [num_blocks * block_size, kv_heads, head_dim] — row
`block * block_size + offset` holds one token position. The pool is `torch.empty`: pages are only
touched (and only then resident) when a block is first written, so a large default budget costs no
memory until load needs it. Which blocks a sequence holds is decided by the torch-free
`workers.blocks.BlockPool`; a forward only receives, per batch row, the rows it writes and reads.

`PagedKVCache` plugs into any transformers decoder through the `Cache` interface (the HF path): each
layer's `update` scatters the new keys/values into their rows, then gathers the rows of every
sequence of the batch into the contiguous [B, kv_heads, kv_len, head_dim] views its attention wants;
the prepared 4-D mask gives each row its own length. The lean path (`workers.llama`, one flattened
forward per step) uses the same pools directly: it writes each token's row and gathers each
sequence's rows itself, without `bind`/`update`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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
    def of(cls, model: Any, dtype: torch.dtype) -> KVGeometry:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, dtype)

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


def default_budget_mb(device: torch.device) -> int:
    """`--kv-budget-mb 0`: a share of the memory free now (after the weights are loaded)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * GPU_SHARE) // 2**20
    return int(psutil.virtual_memory().available * CPU_SHARE) // 2**20


class PagedKVCache(Cache):
    """Block-pool KV buffers behind transformers' `Cache.update`. `bind()` says what a forward writes and reads."""

    def __init__(self, geometry: KVGeometry, *, num_blocks: int, block_size: int, device: torch.device) -> None:
        super().__init__(layers=[])
        # One row past the pool: the zeroed padding row that short rows of a batch read (never garbage:
        # an empty pool may hold NaN bit patterns, and 0 * NaN would leak through the masked softmax).
        self.pad_row = num_blocks * block_size
        shape = (self.pad_row + 1, geometry.kv_heads, geometry.head_dim)
        self.keys = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        self.values = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        for buf in (*self.keys, *self.values):
            buf[self.pad_row].zero_()
        self.block_size = block_size
        self._write = torch.zeros(0, dtype=torch.long, device=device)
        self._read = torch.zeros(0, 0, dtype=torch.long, device=device)

    def rows(self, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """Pool rows of positions 0..kv_len-1 for each sequence: [B, kv_len]; positions past a row's
        length point at the padding row (read, then masked out)."""
        device = self.keys[0].device
        kv_len = max(lengths)
        width = -(-kv_len // self.block_size)
        table = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], dtype=torch.long, device=device)  # [B, width]
        pos = torch.arange(kv_len, device=device)  # [kv_len]
        rows = table[:, pos // self.block_size] * self.block_size + pos % self.block_size  # [B, kv_len]
        valid = pos[None, :] < torch.tensor(lengths, device=device)[:, None]
        return torch.where(valid, rows, self.pad_row)

    def bind(self, write: torch.Tensor, read: torch.Tensor) -> None:
        """write: [B, T] pool rows of the tokens this forward adds; read: [B, kv_len] rows attention reads."""
        self._write = write.reshape(-1)
        self._read = read

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, kv_heads, T, head_dim]
        b, heads, _t, dim = key_states.shape
        k_pool, v_pool = self.keys[layer_idx], self.values[layer_idx]
        k_pool.index_copy_(0, self._write, key_states.transpose(1, 2).reshape(-1, heads, dim))  # [B*T, kv_heads, head_dim]
        v_pool.index_copy_(0, self._write, value_states.transpose(1, 2).reshape(-1, heads, dim))
        kv_len = self._read.shape[1]
        flat = self._read.reshape(-1)  # [B*kv_len]
        keys = k_pool.index_select(0, flat).view(b, kv_len, heads, dim).transpose(1, 2)  # [B, kv_heads, kv_len, head_dim]
        values = v_pool.index_select(0, flat).view(b, kv_len, heads, dim).transpose(1, 2)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self._read.shape[1])
