"""The runner: all torch and transformers code of a worker. Plain functions, tensor shapes in comments.

KV cache design (`SlotKVCache`): per-slot preallocated buffers, one [slots, kv_heads, max_len,
head_dim] tensor pair per layer. A sequence owns one slot from admission to finish, so a step never
copies a sequence's cache; the decode batch reads `buf[slots, :, :kv_len]` (a view when the slots are
contiguous) under a boolean mask giving each row its own length. The number of slots comes from the
KV memory budget (`--kv-budget-mb`) and `max_len`, never from "all free RAM". It plugs into any
transformers decoder through the `Cache` interface and a prepared 4-D mask, so `--model` is not tied
to one architecture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache

from workers.sampling import SamplerRow, TokenLogprobData, breaker_ids, sample
from workers.scheduler import PrefillChunk, Sampled, Sequence, StepPlan

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str) -> torch.dtype:
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"--dtype {name!r}: choose one of {', '.join(table)}")
    return table[name]


def load_model(folder: Path, *, device: torch.device, dtype: torch.dtype) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


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


class SlotKVCache(Cache):
    """Per-slot KV buffers behind transformers' `Cache.update`. `bind()` says where a forward writes."""

    def __init__(self, geometry: KVGeometry, *, num_slots: int, max_len: int, device: torch.device) -> None:
        super().__init__(layers=[])
        shape = (num_slots, geometry.kv_heads, max_len, geometry.head_dim)
        self.keys = [torch.zeros(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        self.values = [torch.zeros(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.layers)]
        self._slots = torch.zeros(0, dtype=torch.long, device=device)
        self._positions = torch.zeros(0, dtype=torch.long, device=device)
        self._range: tuple[int, int] | None = None
        self._kv_len = 0

    def bind(self, slots: list[int], positions: torch.Tensor, kv_len: int) -> None:
        """slots: B slot ids; positions: [B, T] cache positions this forward writes; kv_len: keys to read."""
        device = self.keys[0].device
        self._slots = torch.tensor(slots, dtype=torch.long, device=device)
        self._positions = positions
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self._range = (slots[0], slots[0] + len(slots)) if contiguous else None
        self._kv_len = kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, kv_heads, T, head_dim]
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        rows = self._slots[:, None]  # [B, 1] broadcast against positions [B, T]
        k_buf[rows, :, self._positions] = key_states.transpose(1, 2)  # indexed view: [B, T, kv_heads, head_dim]
        v_buf[rows, :, self._positions] = value_states.transpose(1, 2)
        if self._range is not None:
            lo, hi = self._range
            return k_buf[lo:hi, :, : self._kv_len], v_buf[lo:hi, :, : self._kv_len]  # views [B, kv_heads, kv_len, head_dim]
        return k_buf[self._slots, :, : self._kv_len], v_buf[self._slots, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def move(self, src: int, dst: int) -> None:
        for buf in (*self.keys, *self.values):
            buf[dst].copy_(buf[src])


class TorchRunner:
    """Executes a `StepPlan`: one batched decode forward, then one forward per prefill chunk."""

    def __init__(self, model: Any, *, max_len: int, kv_budget_mb: int, max_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        geometry = KVGeometry.of(model, dtype)
        per_slot = geometry.bytes_per_token() * max_len
        self.num_slots = max(1, min(max_slots, kv_budget_mb * 2**20 // per_slot))
        self.max_len = max_len
        self.kv_bytes = per_slot * self.num_slots
        self.cache = SlotKVCache(geometry, num_slots=self.num_slots, max_len=max_len, device=device)
        self._generators: dict[str, torch.Generator] = {}
        self.eos_ids: tuple[int, ...] = ()  # set by the engine's builder: banned while min_tokens is not reached
        self.tokenizer: Any = None  # set likewise: turns dry_sequence_breakers into token ids
        self._breakers: dict[str, frozenset[int]] = {}  # per sequence, like the generators
        self.mask_s = 0.0  # seconds spent on grammar masks, over `masked_steps` steps (heartbeat figures)
        self.masked_steps = 0
        log.info("KV cache: %d slots x %d tokens (%.0f MiB)", self.num_slots, max_len, self.kv_bytes / 2**20)

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.key, None)
        self._breakers.pop(seq.key, None)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[Sampled]:
        rows: list[Sequence] = []
        logits: list[torch.Tensor] = []
        if plan.decode:
            logits.append(self._decode(plan.decode))
            rows.extend(plan.decode)
        for chunk in plan.prefill:
            out = self._prefill(chunk)
            if chunk.completes_prompt:
                logits.append(out)
                rows.append(chunk.seq)
        if not rows:
            return []
        stacked = torch.cat(logits).float()  # [B, vocab]
        result = sample(stacked, [self._sampler_row(s) for s in rows])
        if result.mask_s:
            self.mask_s += result.mask_s
            self.masked_steps += 1
        return [_sampled(seq, token, lp) for seq, token, lp in zip(rows, result.tokens, result.logprobs, strict=True)]

    def _sampler_row(self, seq: Sequence) -> SamplerRow:
        params = seq.request.sampling
        gen = self._generators.get(seq.key)
        if gen is None and params.seed is not None:
            gen = self._generators[seq.key] = torch.Generator(device=self.device)
        if gen is not None and params.seed is not None:
            # Seeded per output position: token k is drawn the same way whatever came before in this
            # process, so a request resumed on another worker (or after a preemption) draws what an
            # uninterrupted run would have drawn.
            gen.manual_seed((params.seed * 1_000_003 + len(seq.output)) % 2**63)
        breakers = self._breakers.get(seq.key, frozenset())
        if params.dry_multiplier > 0 and self.tokenizer is not None and seq.key not in self._breakers:
            breakers = self._breakers[seq.key] = breaker_ids(self.tokenizer, params.dry_sequence_breakers)
        return SamplerRow(params=params, generator=gen, prompt=seq.prompt, output=seq.output, eos_ids=self.eos_ids, dry_breakers=breakers, grammar=seq.grammar)

    def _forward(self, slots: list[int], input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [B, T]; returns last-position logits [B, vocab]
        kv_len = int(positions.max().item()) + 1
        key_pos = torch.arange(kv_len, device=self.device)  # [kv_len]
        mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, kv_len] causal per row
        self.cache.bind(slots, positions, kv_len)
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _decode(self, seqs: tuple[Sequence, ...]) -> torch.Tensor:
        slots = [s.slot for s in seqs]
        input_ids = torch.tensor([[s.output[-1]] for s in seqs], device=self.device)  # [B, 1]
        positions = torch.tensor([[s.computed] for s in seqs], device=self.device)  # [B, 1]
        return self._forward(slots, input_ids, positions)  # type: ignore[arg-type]

    def _prefill(self, chunk: PrefillChunk) -> torch.Tensor:
        seq = chunk.seq
        input_ids = torch.tensor([seq.context[chunk.start : chunk.end]], device=self.device)  # [1, T]
        positions = torch.arange(chunk.start, chunk.end, device=self.device)[None, :]  # [1, T]
        assert seq.slot is not None
        return self._forward([seq.slot], input_ids, positions)


def _sampled(seq: Sequence, token: int, logprob: TokenLogprobData | None) -> Sampled:
    if logprob is None:
        return Sampled(seq, token)
    return Sampled(seq, token, logprob.logprob, tuple(logprob.top))
