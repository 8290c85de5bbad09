"""The runner: all torch and transformers code of a worker. Plain functions, tensor shapes in comments.

KV cache: the paged block pool of `workers.kv_cache` (blocks of `BLOCK_SIZE` positions, sized by
`--kv-budget-mb`, or a share of free memory by default). Each forward gets, per batch row, the pool
rows its new tokens go to and the rows of the sequence's positions so far (from its block table);
a boolean 4-D mask gives each row its own length. It plugs into any transformers decoder through the
`Cache` interface, so `--model` is not tied to one architecture (Llama, Qwen2/3, Mistral included).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from workers.blocks import BLOCK_SIZE
from workers.kv_cache import KVGeometry, PagedKVCache, default_budget_mb
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


class TorchRunner:
    """Executes a `StepPlan`: one batched decode forward, then one forward per prefill chunk."""

    def __init__(self, model: Any, *, max_len: int, kv_budget_mb: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        geometry = KVGeometry.of(model, dtype)
        budget_mb = kv_budget_mb or default_budget_mb(device)
        per_block = geometry.bytes_per_token() * BLOCK_SIZE
        self.block_size = BLOCK_SIZE
        self.num_blocks = max(1, budget_mb * 2**20 // per_block)
        self.max_len = max_len
        self.kv_bytes = per_block * self.num_blocks
        self.cache = PagedKVCache(geometry, num_blocks=self.num_blocks, block_size=BLOCK_SIZE, device=device)
        self._generators: dict[str, torch.Generator] = {}
        self.eos_ids: tuple[int, ...] = ()  # set by the engine's builder: banned while min_tokens is not reached
        self.tokenizer: Any = None  # set likewise: turns dry_sequence_breakers into token ids
        self._breakers: dict[str, frozenset[int]] = {}  # per sequence, like the generators
        self.mask_s = 0.0  # seconds spent on grammar masks, over `masked_steps` steps (heartbeat figures)
        self.masked_steps = 0
        self.masked_rows = 0  # constrained rows masked, summed over those steps
        how = "--kv-budget-mb" if kv_budget_mb else "default: a share of free memory"
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, %s)", self.num_blocks, BLOCK_SIZE, self.num_blocks * BLOCK_SIZE, self.kv_bytes / 2**20, how)

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
            self.masked_rows += sum(s.grammar is not None for s in rows)
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

    def _forward(self, seqs: list[Sequence], input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [B, T]; returns last-position logits [B, vocab]
        lengths = (positions[:, -1] + 1).tolist()  # keys each row attends to, its new tokens included
        read = self.cache.rows([s.blocks for s in seqs], lengths)  # [B, kv_len]
        key_pos = torch.arange(read.shape[1], device=self.device)  # [kv_len]
        mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, kv_len] causal per row
        self.cache.bind(read.gather(1, positions), read)
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _decode(self, seqs: tuple[Sequence, ...]) -> torch.Tensor:
        input_ids = torch.tensor([[s.output[-1]] for s in seqs], device=self.device)  # [B, 1]
        positions = torch.tensor([[s.computed] for s in seqs], device=self.device)  # [B, 1]
        return self._forward(list(seqs), input_ids, positions)

    def _prefill(self, chunk: PrefillChunk) -> torch.Tensor:
        seq = chunk.seq
        input_ids = torch.tensor([seq.context[chunk.start : chunk.end]], device=self.device)  # [1, T]
        positions = torch.arange(chunk.start, chunk.end, device=self.device)[None, :]  # [1, T]
        return self._forward([seq], input_ids, positions)


def _sampled(seq: Sequence, token: int, logprob: TokenLogprobData | None) -> Sampled:
    if logprob is None:
        return Sampled(seq, token)
    return Sampled(seq, token, logprob.logprob, tuple(logprob.top))
