"""The runner: all torch and transformers code of a worker. Plain functions, tensor shapes in comments.

KV cache: the paged block pool of `workers.kv_cache` (blocks of `BLOCK_SIZE` positions, sized by
`--kv-budget-mb`, or a share of free memory by default).

Two model paths (`--model-impl`, MET_MODEL_IMPL; default `auto`: lean for the Llama family, hf for the
rest). On CPU both run the same attention (`llama._attend`), so they prefill long prompts equally fast;
lean decodes faster (one forward a step, fused projections: 32.5 vs 44 ms a token for one stream on a
2-core AVX2 machine, bench/RESULTS.md session 11):
- lean (`auto` picks it for the Llama family, `workers.llama`; `load` reads its weights straight from the
  folder, `workers.checkpoint`, so a worker never imports transformers' model code): ONE forward per step — the decode
  tokens of every running sequence and this step's prefill chunks flattened into one [tokens] batch
  (`step_batch`), each token with its position and the pool row it writes; attention reads each
  sequence's keys/values through its block table. On CPU in bf16 a token's logits do not depend on its
  batch mates, on where its prompt was cut into chunks, or on prefix-cache hits (`llama._attend`), so
  a seeded request samples the same tokens however it was scheduled, and a replay reproduces it.
- hf (any other architecture, or asked for): transformers' generic forward, once for the decode batch
  and once per prefill chunk; per batch row the pool rows its new tokens go to and the rows of the
  sequence's positions so far, a boolean 4-D mask giving each row its own length, plugged in through
  the `Cache` interface (`PagedKVCache.bind`). On CPU its attention is the lean path's too
  (`llama.hf_attention`, registered with transformers as "metrale"): torch's CPU SDPA gives a token other
  bf16 values when its prompt is cut otherwise or its prefix comes from the cache (on AVX2-only CPUs
  enough to change a greedy token), and `met replay` and seeded requests rely on it not doing so.

On a CPU without native bf16 the lean path multiplies some rows' projections in float32 (`wide_mode`,
`step_batch`): oneDNN emulates bf16 GEMMs there at 0.23 ms a row for SmolLM2's gate/up projection,
so a 512-token prefill step took 6.5 s and a 32-stream decode step 611 ms (session 12).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from models.adapters import Base
from workers import checkpoint, llama, lora, prompt_logprobs, quant
from workers.blocks import BLOCK_SIZE
from workers.kv_cache import KVGeometry, PagedKVCache, block_tables, default_budget_mb
from workers.sampling import SamplerRow, TokenLogprobData, breaker_ids, sample
from workers.scheduler import Draft, PrefillChunk, Sampled, Sequence, StepPlan

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
    """The transformers model (the hf path, and the tests' reference forward)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def load(folder: Path, *, device: torch.device, dtype: torch.dtype, model_impl: str, max_len: int) -> tuple[Any, llama.LlamaWeights | None, dict[str, Any]]:
    """(transformers' model or None, the lean weights or None, config.json) for `TorchRunner`: a Llama-family
    folder the lean path runs is read straight into its weights (`workers.checkpoint`, without transformers'
    model code); anything else, or `--model-impl hf`, loads through transformers."""
    config = checkpoint.read_config(folder)
    if model_impl != "hf":
        lean, why = checkpoint.load(folder, max_len=max_len, device=device, dtype=dtype, config=config)
        if lean is not None:
            log.info("weights: read into the lean layout directly (workers.checkpoint)")
            return None, lean, config
        log.info("weights: through transformers (%s)", why)
    return load_model(folder, device=device, dtype=dtype), None, config


MODEL_IMPLS = ("auto", "lean", "hf")


class TorchRunner:
    """Executes a `StepPlan`: one flattened forward (lean), or a decode forward plus one per chunk (hf)."""

    def __init__(  # noqa: PLR0913 (keyword-only: the model, as loaded, and where and how it runs)
        self,
        model: Any,
        *,
        max_len: int,
        kv_budget_mb: int,
        device: torch.device,
        dtype: torch.dtype,
        model_impl: str = "auto",
        lean: llama.LlamaWeights | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`model`: transformers' model; or None with `lean` and its `config` (`load`: read directly)."""
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"--model-impl {model_impl!r}: choose one of {', '.join(MODEL_IMPLS)}")
        self.dtype = dtype
        self.model = model
        self.device = device
        self.config: Any = model.config if model is not None else config
        self.geometry = geometry = KVGeometry.of(self.config, dtype) if lean is None else KVGeometry(len(lean.layers), lean.kv_heads, lean.head_dim, dtype)
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
        why_not = None if lean is not None else llama.unsupported(model, max_len=max_len) if model_impl != "hf" else "--model-impl hf"
        if why_not is not None and model_impl == "lean":
            raise ValueError(f"--model-impl lean: {why_not}")
        self.lean = lean if lean is not None else llama.from_hf(model) if why_not is None else None
        if self.lean is None and device.type == "cpu":
            from transformers import AttentionInterface

            AttentionInterface.register("metrale", llama.hf_attention)
            model.set_attn_implementation("metrale")  # the hf path's attention: `llama.hf_attention`
        self.adapters: lora.Adapters | None = None  # `enable_adapters`: the resident LoRA adapters
        self._held: dict[str, lora.Adapter] = {}  # per sequence, its adapter (`attach`)
        self._hooks: lora.HfHooks | None = None  # the hf path's adapter hooks
        self.quantization = "none"
        self.batch_invariant = False  # `--batch-invariant`: decode rows keep bf16 projections (`wide_mode`); set before the engine is built
        self.widen: bool | None = None  # projections in float32 where `wide_mode` says (None: where bf16 is not native)
        log.info("model path: %s", "lean (one flattened forward per step)" if self.lean else f"hf (generic forward; {why_not})")
        how = "--kv-budget-mb" if kv_budget_mb else "default: a share of free memory"
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, %s)", self.num_blocks, BLOCK_SIZE, self.num_blocks * BLOCK_SIZE, self.kv_bytes / 2**20, how)

    def quantize(self, quantization: str) -> TorchRunner:
        """`--quantization`: the decoder's linears as int4 (workers.quant) on whichever path runs (`auto`:
        where lossless); once, before the first step. `self.quantization` says what runs."""
        linears = quant.lean_linears(self.lean) if self.lean is not None else quant.hf_linears(self.model)
        self.quantization, why = quant.resolve(quantization, linears, self.device, self.dtype)
        if self.quantization == "int4":
            if self.lean is not None:
                self.lean = quant.quantize_lean(self.model, self.lean)
            else:
                quant.quantize_hf(self.model)
            quant.give_back_memory()
        what = f"int4, the decoder's linears, group {quant.GROUP} (workers.quant)" if self.quantization == "int4" else "as loaded"
        log.info("weights: %s (%s)", what, why)
        return self

    @property
    def wide_mode(self) -> str:
        """Which rows of a lean step multiply their projections in float32 (`step_batch`): "off" but for bf16
        weights on a CPU without native bf16, where oneDNN emulates bf16 GEMMs at a cost linear in the rows
        (`quant.linear`). There prompt tokens always do ("prompt", with `batch_invariant`), so a prompt's
        keys/values are the same however it is chunked or cached; by default ("auto") so does every row of
        a step with prompt tokens or at least WIDE_MIN_ROWS rows, and a decode row then gets other low
        bits alone than among many (with `batch_invariant` decode rows stay bf16, row-invariant there)."""
        widen = self.widen if self.widen is not None else not llama.native_bf16()
        if self.lean is None or self.quantization != "none" or self.dtype != torch.bfloat16 or self.device.type != "cpu" or not widen:
            return "off"
        return "prompt" if self.batch_invariant else "auto"

    def enable_adapters(self, *, max_loras: int, max_rank: int) -> TorchRunner:
        """Serve LoRA adapters (`workers.lora`): up to `max_loras` resident, each of rank at most `max_rank`;
        on the hf path through forward hooks on its projections. Before the first step."""
        self.adapters = lora.Adapters(Base.of(self.config), max_loras=max_loras, max_rank=max_rank, dtype=self.dtype, device=self.device, lean=self.lean is not None)
        if self.lean is None:
            self._hooks = lora.HfHooks(self.model)
        return self

    def attach(self, seq: Sequence) -> str | None:
        """Hold the adapter the sequence's request names (loaded now if it is not resident): None, or why it cannot run."""
        request = seq.request
        if self.adapters is None:
            return f"This worker serves no LoRA adapters (the request asks for '{request.adapter}')."
        try:
            self._held[seq.key] = self.adapters.hold(request.adapter, request.adapter_path)
        except lora.AdapterError as exc:
            return f"The LoRA adapter '{request.adapter}' cannot be loaded: {exc}"
        return None

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.key, None)
        self._breakers.pop(seq.key, None)
        adapter = self._held.pop(seq.key, None)
        if adapter is not None and self.adapters is not None:
            self.adapters.let_go(adapter)

    @property
    def verifies(self) -> bool:
        """Whether a plan may carry drafts (speculative decoding): the lean path's flattened step only."""
        return self.lean is not None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[Sampled]:
        rows, logits = self.forward(plan)
        if not rows:
            return []
        return self.sample(rows, logits, _ahead(len(rows), plan.verify)) if plan.verify else self.sample(rows, logits)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[list[Sequence], torch.Tensor]:
        """The step's model work: the sequences that sample, and their logits [R, vocab] float32."""
        if self.lean is not None:
            if plan.empty:
                return [], torch.empty(0)
            held = (self._held, self.adapters.stack) if self._held and self.adapters is not None else None
            batch, rows = step_batch(plan, block_size=self.block_size, pad_block=self.cache.pad_block, device=self.device, wide=self.wide_mode, adapters=held)
            return rows, llama.forward(self.lean, batch, self.cache.keys, self.cache.values).float()
        return self._hf_forward(plan)

    def _hf_forward(self, plan: StepPlan) -> tuple[list[Sequence], torch.Tensor]:
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
            return [], torch.empty(0)
        return rows, torch.cat(logits).float()  # [B, vocab]

    @torch.inference_mode()
    def score_prompt(self, prompt: list[int], top: int) -> prompt_logprobs.Scored:
        """Prompt logprobs (`workers.prompt_logprobs`): on the lean path its own forward, CHUNK positions at a
        time, into a cache of the prompt's own (the runner's pool and the scheduler are not involved; its
        prompt rows multiply as a prefill's do: `wide_mode`); on the hf path transformers' forward."""
        if self.lean is None:
            return prompt_logprobs.score_prompt(self.model, prompt, top, device=self.device)
        cache = PagedKVCache(self.geometry, num_blocks=-(-len(prompt) // self.block_size), block_size=self.block_size, device=self.device)
        out: prompt_logprobs.Scored = []
        for start in range(0, len(prompt) - 1, prompt_logprobs.CHUNK):
            end = min(start + prompt_logprobs.CHUNK, len(prompt) - 1)  # positions start..end-1, each followed by a prompt token
            batch = prompt_chunk(prompt, start, end, block_size=self.block_size, pad_block=cache.pad_block, device=self.device, wide=self.wide_mode != "off")
            logits = llama.forward(self.lean, batch, cache.keys, cache.values)  # [end - start, vocab]
            out += prompt_logprobs.scores(logits, torch.tensor(prompt[start + 1 : end + 1], device=self.device), top)
        return out

    @torch.inference_mode()
    def sample(self, rows: list[Sequence], logits: torch.Tensor, ahead: list[tuple[int, ...]] | None = None) -> list[Sampled]:
        """One token per row; `ahead`: per row, the guesses of its draft before it (`_ahead`)."""
        result = sample(logits, [self._sampler_row(s, a) for s, a in zip(rows, ahead or [()] * len(rows), strict=True)])
        if result.mask_s:
            self.mask_s += result.mask_s
            self.masked_steps += 1
            self.masked_rows += sum(s.grammar is not None for s in rows)
        return [_sampled(seq, token, lp) for seq, token, lp in zip(rows, result.tokens, result.logprobs, strict=True)]

    def _sampler_row(self, seq: Sequence, ahead: tuple[int, ...] = ()) -> SamplerRow:
        """A draft's row after `ahead` guesses samples as the sequence would once it had them: penalties see
        them as output, a seed draws for that position (its own generator), and a grammar's matcher, which
        stands before the guesses, is left out (the engine keeps such a row's token only where it confirms
        a guess the matcher allowed: `Engine._verify`)."""
        params = seq.request.sampling
        if ahead:
            output = [*seq.output, *ahead]
            drawn = None
            if params.seed is not None:
                drawn = torch.Generator(device=self.device).manual_seed((params.seed * 1_000_003 + len(output)) % 2**63)
            breakers = self._breakers.get(seq.key, frozenset())
            return SamplerRow(params=params, generator=drawn, prompt=seq.prompt, output=output, eos_ids=self.eos_ids, dry_breakers=breakers)
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
        read = self.cache.tables([s.blocks for s in seqs], lengths)  # [B, W]
        kv_len = max(lengths)
        key_pos = torch.arange(kv_len, device=self.device)  # [kv_len]: exactly the longest row's keys (see kv_cache)
        mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, kv_len] causal per row
        write = read.gather(1, positions // self.block_size) * self.block_size + positions % self.block_size  # [B, T] pool rows
        self.cache.bind(write, read, kv_len)
        if self._hooks is not None:  # flat row b * T + t is token t of seqs[b]
            self._hooks.active = lora.step_rows([self._held.get(s.key) for s in seqs for _ in range(input_ids.shape[1])], self.device)
        try:
            out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=self.cache, use_cache=True, logits_to_keep=1)
        finally:
            if self._hooks is not None:
                self._hooks.active = None
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


WIDE_MIN_ROWS = 6  # `wide_mode` "auto": a step of this many rows multiplies all of them in float32 (the crossover, session 12)


def step_batch(
    plan: StepPlan,
    *,
    block_size: int,
    pad_block: int,
    device: torch.device,
    wide: str = "off",
    adapters: tuple[dict[str, lora.Adapter], lora.Stack] | None = None,
) -> tuple[llama.StepBatch, list[Sequence]]:
    """A plan flattened for `llama.forward`: decode tokens first, longest first, then each prefill chunk's
    tokens; and the sequences of its sampled rows, in their order. `wide` (`TorchRunner.wide_mode`) picks
    the rows whose projections multiply in float32: the prompt tokens' ("prompt"), or every row of a step
    with prompt tokens or WIDE_MIN_ROWS rows ("auto") but generated tokens computed again (resume,
    preemption), which stay bf16 as they were when their sequence decoded alone. `adapters`: per sequence
    key its LoRA adapter (`TorchRunner.attach`) and the resident ones' stack, so each row adds its own
    adapter's deltas."""
    decode = sorted(plan.decode, key=lambda s: s.computed, reverse=True)
    ids: list[int] = [s.output[-1] for s in decode]
    positions: list[int] = [s.computed for s in decode]
    tables = [s.blocks for s in decode]
    chunk_spans: list[tuple[int, PrefillChunk]] = []
    for c in plan.prefill:
        chunk_spans.append((len(ids), c))
        ids.extend(c.seq.context[c.start : c.end])
        positions.extend(range(c.start, c.end))
    # a draft is a chunk of generated tokens: its last token and its guesses, every row sampled
    draft_spans: list[tuple[int, Draft]] = []
    for d in plan.verify:
        draft_spans.append((len(ids), d))
        ids.extend((d.seq.output[-1], *d.tokens))
        positions.extend(range(d.seq.computed, d.seq.computed + d.rows))
    seqs = [*decode, *(c.seq for c in plan.prefill for _ in range(c.end - c.start)), *(d.seq for d in plan.verify for _ in range(d.rows))]
    write = [s.blocks[p // block_size] * block_size + p % block_size for s, p in zip(seqs, positions, strict=True)]
    decode_blocks = decode_mask = None
    ends = [p + 1 for p in positions[: len(decode)]]
    if decode:
        span = llama.key_span(ends[0])
        decode_blocks = block_tables(tables, ends, width=span // block_size, block_size=block_size, pad_block=pad_block).to(device, non_blocking=True)  # [B, P / block_size]
        valid = torch.arange(span)[None, :] < torch.tensor(ends)[:, None]  # [B, P]
        decode_mask = valid[:, None, None, :].to(device, non_blocking=True)  # [B, 1, 1, P]
    chunks = [chunk_at(offset, c.seq.blocks, c.start, c.end, block_size=block_size, pad_block=pad_block, device=device) for offset, c in chunk_spans]
    chunks += [chunk_at(offset, d.seq.blocks, d.seq.computed, d.seq.computed + d.rows, block_size=block_size, pad_block=pad_block, device=device) for offset, d in draft_spans]
    sample_at = list(range(len(decode))) + [offset + c.end - c.start - 1 for offset, c in chunk_spans if c.completes_prompt]
    sample_at += [i for offset, d in draft_spans for i in range(offset, offset + d.rows)]
    rows = [] if wide == "off" else [i for offset, c in chunk_spans for i in range(offset, offset + max(0, min(c.end, len(c.seq.prompt)) - c.start))]
    # the generated tokens a chunk computes again (a resumed attempt, a preempted sequence): they were
    # decode rows, bf16 when their sequence ran alone, and stay so
    again = {i for offset, c in chunk_spans for i in range(offset + max(0, len(c.seq.prompt) - c.start), offset + c.end - c.start)}
    # a draft's rows are decode rows, wide where the step's are; its guesses do not count towards WIDE_MIN_ROWS,
    # so a step widens (or not) as it would without them
    guesses = sum(len(d.tokens) for d in plan.verify)
    if wide == "auto" and (rows or len(ids) - guesses >= WIDE_MIN_ROWS):
        rows = [i for i in range(len(ids)) if i not in again]
    wide_rows = torch.tensor(rows, dtype=torch.long, device=device) if rows else None
    narrow_rows = None if not rows or len(rows) == len(ids) else torch.tensor(sorted(set(range(len(ids))) - set(rows)), dtype=torch.long, device=device)
    batch = llama.StepBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        write=torch.tensor(write, dtype=torch.long, device=device),
        decode=len(decode),
        decode_ends=tuple(ends),
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        chunks=tuple(chunks),
        sample=torch.tensor(sample_at, dtype=torch.long, device=device),
        wide=wide_rows,
        narrow=narrow_rows,
        wide_head=wide == "auto" and wide_rows is not None and not again.intersection(sample_at),  # "prompt": bf16, row-invariant, whichever row samples
        lora=lora.stacked_rows([adapters[0].get(s.key) for s in seqs], adapters[1], device, chunks=tuple((o, c.end - c.start) for o, c in chunk_spans)) if adapters else None,
    )
    return batch, [*decode, *(c.seq for c in plan.prefill if c.completes_prompt), *(d.seq for d in plan.verify for _ in range(d.rows))]


def chunk_at(offset: int, table: list[int], start: int, end: int, *, block_size: int, pad_block: int, device: torch.device) -> llama.Chunk:  # noqa: PLR0913 (keyword-only: the cache's layout)
    """Positions start..end-1 of one sequence (its block `table`), at `offset` in the flat batch: a
    prefill chunk, a draft's rows, or a prompt being scored."""
    span = llama.key_span(end)
    blocks = block_tables([table], [end], width=span // block_size, block_size=block_size, pad_block=pad_block)  # [1, P / block_size]
    mask = torch.arange(span)[None, :] <= torch.arange(start, end)[:, None]  # [T, P] causal from position start
    return llama.Chunk(offset=offset, length=end - start, end=end, blocks=blocks.to(device, non_blocking=True), mask=mask.to(device, non_blocking=True))


def prompt_chunk(prompt: list[int], start: int, end: int, *, block_size: int, pad_block: int, device: torch.device, wide: bool) -> llama.StepBatch:  # noqa: PLR0913 (keyword-only: the cache's layout)
    """Positions start..end-1 of a prompt as one prefill chunk whose every row gives logits, in a cache
    holding this prompt alone from block 0 (`TorchRunner.score_prompt`); `wide`: its rows' projections
    and its lm_head in float32 (a CPU without native bf16: `TorchRunner.wide_mode`)."""
    table = list(range(-(-len(prompt) // block_size)))
    rows = torch.arange(end - start, device=device)
    return llama.StepBatch(
        input_ids=torch.tensor(prompt[start:end], dtype=torch.long, device=device),
        positions=torch.arange(start, end, device=device),
        write=torch.arange(start, end, device=device),  # block b holds positions b * block_size...: pool row = position
        decode=0,
        decode_ends=(),
        decode_blocks=None,
        decode_mask=None,
        chunks=(chunk_at(0, table, start, end, block_size=block_size, pad_block=pad_block, device=device),),
        sample=rows,
        wide=rows if wide else None,
        wide_head=wide,
    )


def _ahead(rows: int, verify: tuple[Draft, ...]) -> list[tuple[int, ...]]:
    """Per sampled row of `rows`, the guesses of its draft before it: drafts' rows come last, each draft's
    in order (`step_batch`); the other rows have none."""
    drafted = [d.tokens[:i] for d in verify for i in range(d.rows)]
    return [()] * (rows - len(drafted)) + drafted


def _sampled(seq: Sequence, token: int, logprob: TokenLogprobData | None) -> Sampled:
    if logprob is None:
        return Sampled(seq, token)
    return Sampled(seq, token, logprob.logprob, tuple(logprob.top))
