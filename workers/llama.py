"""Our own forward for the Llama family (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral): plain functions.

Owns: the weights of a loaded transformers model regrouped for one flattened (varlen) step — fused
QKV and gate/up projections — and `forward`, which runs every token of a step (the decode tokens of
all running sequences and this step's prefill chunks) through the model as one [tokens, hidden]
batch, writes each token's keys/values to its pool rows of the paged cache (`workers.kv_cache`), and
reads each sequence's keys/values by its block table. Logits only for the rows that sample.

Attention (CPU) is one function for decode rows and prefill chunks alike, written so that a token's
output is a function of its own query and keys only — never of its batch mates, of where the scheduler
split its prompt into chunks, or of whether its prefix came from the cache (`_attend`; measured in
`tests/workers/test_llama.py`). The projections follow `StepBatch.wide` (the runner's `wide_mode`): on a
CPU without native bf16 the rows it names multiply in float32 (`_project`, `quant.linear`) — oneDNN
emulates bf16 there, one row at a time — and the rest in bf16. Prompt tokens always go one way, so
chunking and prefix reuse never change a logit; whether a decode row's logits depend on its batch
mates is the runner's choice (`--batch-invariant`). Keys are gathered from the paged cache in whole (block, head) tiles
(`kv_cache.read_index`), laid out so that each run of `KEY_BLOCK` absolute positions of one head is a
dense matrix the bmm reads in place, with an online softmax across key blocks in float32: the bf16 GEMMs of
oneDNN give the same row whatever the other rows and whatever zero tail follows, and a key masked out
adds exactly nothing. Reads are ragged: decode rows come longest first (`StepBatch.decode_ends`),
and each key block is gathered and multiplied only for the rows that reach it (`key_tiles`), the
last block cut at a multiple of KEY_ALIGN past the longest row rather than padded to KEY_BLOCK (its
gain is not shown by a clean measurement yet: bench/RESULTS.md, session 9). torch's SDPA is not like
that on CPU: its flash kernel's blocking and its tail
`exp` depend on the query and key lengths of the call, so the same prompt prefilled in one chunk or in
two gave logits up to 0.7 apart, and a seeded request sampled differently depending on what else ran
(measured: `bench/RESULTS.md`, session 7). The price is prefill attention: 10.4 vs 5.4 ms a layer for a
512-token chunk, 72 vs 43 ms at 4,096 keys; decode is faster (3.3 vs 20 ms for 32 rows of 1,024 keys;
`python bench/attention.py` on a 2-core AVX2 machine, session 11). CUDA keeps SDPA (no such promise).

A worker reads the weights straight from the folder into this layout (`workers.checkpoint`, without
transformers' model code). Where that module leaves a folder to transformers, or a test holds an HF
model as the reference, they come from the HF model's own parameters (`from_hf`): its q/k/v and
gate/up parameters are re-pointed at views of the fused tensors, so the fused copy costs no memory and
the HF forward still works. With
`--quantization int4` the four projections are int4 weights (`workers.quant`), the rest as loaded.

Must not: know sequences or the scheduler (the runner turns a `StepPlan` into a `StepBatch`), or
accept a configuration it does not implement: `unsupported` names why, and the runner then keeps
the generic HF path (other architectures, sliding windows, dynamic/longrope RoPE, non-SiLU MLPs).

Size (~490 lines): the whole lean forward of the Llama family (weights, RoPE, paged attention, the MLP),
whose exactness promises depend on each other; kept in one place so they are read together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workers import lora
from workers.kernels import native_bf16
from workers.kv_cache import fresh_blocks, gather, read_index, write_index
from workers.quant import Weight, linear

FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})  # inv_freq fixed at load time
KEY_BLOCK = 512  # keys per block of the online softmax, at fixed absolute positions 0, 512, 1024, ...
FEW_ROWS = 4  # float32 attention products are made with at least this many query rows (`_product`)
WEIGH_KEYS = 256  # a float32 p @ V is summed in pieces of this many keys (`_weigh`)
KEY_ALIGN = 64  # a key block is cut short at a multiple of this past the longest row's keys (16 was measured not to keep rows invariant)


def key_span(length: int) -> int:
    """How many key positions an attention over `length` keys reads (the rest masked out): a multiple of
    KEY_ALIGN, so every key block is KEY_BLOCK wide but the last, which is a multiple of KEY_ALIGN."""
    return -(-length // KEY_ALIGN) * KEY_ALIGN


@dataclass(frozen=True, slots=True)
class Layer:
    index: int  # its place in the model (a LoRA adapter's pairs are per layer: `workers.lora`)
    input_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2)
    o: Weight  # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    inv_freq: torch.Tensor  # [head_dim / 2] float32
    rope_scale: float  # the RoPE type's attention scaling of cos/sin (1.0 but for yarn)
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[Layer, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


@dataclass(frozen=True, slots=True)
class Chunk:
    """A prefill chunk inside the flat batch: tokens [offset, offset + length) at positions start…"""

    offset: int
    length: int
    end: int  # its last position + 1: the keys its last token attends to
    blocks: torch.Tensor  # [1, P / block_size] pool blocks of key positions 0.. (P = key_span(start + length); the padding block past the end)
    mask: torch.Tensor  # [length, P] bool, True where a query may attend (causal from position start)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step, flattened: decode tokens first (one per sequence, longest first), then the prefill chunks in order."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    write: torch.Tensor  # [N] pool rows (block * block_size + offset) the tokens' keys/values go to
    decode: int  # the first `decode` tokens are decode rows
    decode_ends: tuple[int, ...]  # [B] the keys each decode row attends to, its own included; non-increasing
    decode_blocks: torch.Tensor | None  # [B, P / block_size] pool blocks each decode row reads (the padding block past its length)
    decode_mask: torch.Tensor | None  # [B, 1, 1, P] bool
    chunks: tuple[Chunk, ...]
    sample: torch.Tensor  # [R] flat indices of the tokens whose logits are sampled
    wide: torch.Tensor | None = None  # [W] rows whose projections multiply in float32 (`_project`); None: no row
    narrow: torch.Tensor | None = None  # [N - W] the other rows, when only some are wide; None: every row is
    wide_head: bool = False  # the lm_head multiplies the sampled rows in float32 too
    lora: lora.StackedRows | None = None  # the rows that run a LoRA adapter and their adapters' slots (`workers.lora`); None: none does


def unsupported(model: Any, *, max_len: int) -> str | None:
    """Why our forward cannot run this model (None: it can)."""
    cfg = model.config
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if cfg.model_type in FAMILIES and (rotary is None or not hasattr(model.model, "layers")):
        return "no model.layers / rotary_emb"
    why = unsupported_config(cfg, max_len=max_len, rope_type=rotary.rope_type if rotary is not None else "default")
    if why is None and getattr(model.model.layers[0].mlp.gate_proj, "bias", None) is not None:
        return "MLP biases"
    return why


def unsupported_config(config: Any, *, max_len: int, rope_type: str) -> str | None:
    """Why our forward cannot run a model of this config (transformers' config, or config.json as a dict;
    `rope_type` as the config resolves it), None: it can. Shared by the loaded-model check (`unsupported`)
    and the direct load (`workers.checkpoint`)."""

    def get(name: str, default: Any = None) -> Any:
        return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)

    model_type = get("model_type")
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} is not a Llama-family model"
    if rope_type not in STATIC_ROPE:
        return f"RoPE type {rope_type!r} is not implemented"
    if get("hidden_act", "silu") != "silu":
        return f"hidden_act {get('hidden_act')!r}"
    window = get("sliding_window")
    uses_window = model_type == "mistral" or get("use_sliding_window", False)
    if window and uses_window and window < max_len:
        return f"sliding window {window} < max_len {max_len}"
    if any(t != "full_attention" for t in get("layer_types") or ()):
        return "layers other than full attention"
    if get("mlp_bias", False):
        return "MLP biases"
    return None


def _fuse(linears: list[Any], attr: str) -> torch.Tensor | None:
    """Concatenate the linears' weights (or biases) along dim 0 and re-point each at its slice."""
    parts = [getattr(m, attr) for m in linears]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.data for p in parts])
    start = 0
    for p in parts:
        p.data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused


def from_hf(model: Any) -> LlamaWeights:
    """Our weights from a loaded HF Llama-family model (check `unsupported` first)."""
    cfg, inner = model.config, model.model
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for index, block in enumerate(inner.layers):
        attn, mlp = block.self_attn, block.mlp
        qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
        gate_up = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        assert qkv is not None and gate_up is not None
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        layers.append(
            Layer(
                index=index,
                input_norm=block.input_layernorm.weight.data,
                qkv=qkv,
                qkv_bias=_fuse([attn.q_proj, attn.k_proj, attn.v_proj], "bias"),
                o=attn.o_proj.weight.data,
                o_bias=attn.o_proj.bias.data if attn.o_proj.bias is not None else None,
                q_norm=q_norm.weight.data if q_norm is not None else None,
                k_norm=k_norm.weight.data if k_norm is not None else None,
                post_norm=block.post_attention_layernorm.weight.data,
                gate_up=gate_up,
                down=mlp.down_proj.weight.data,
            )
        )
    return LlamaWeights(
        heads=cfg.num_attention_heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        eps=cfg.rms_norm_eps,
        inv_freq=inner.rotary_emb.inv_freq.float(),
        rope_scale=float(inner.rotary_emb.attention_scaling),
        embed=inner.embed_tokens.weight.data,
        layers=tuple(layers),
        norm=inner.norm.weight.data,
        lm_head=model.lm_head.weight.data,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., dim]; in float32 like transformers' LlamaRMSNorm, the weight applied in x's dtype
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_tables(w: LlamaWeights, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [N] → cos, sin: [N, 1, head_dim] in the model's dtype (shared by every layer)
    freqs = positions[:, None].float() * w.inv_freq.to(positions.device)[None, :]  # [N, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * w.rope_scale).to(dtype)[:, None, :], (emb.sin() * w.rope_scale).to(dtype)[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, head_dim]; the half-split rotation of transformers' rotate_half
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True, slots=True)
class Reads:
    """What one attention call gathers (`key_tiles`): the tile index, and per key block the rows that reach
    it — the first ones, rows being longest first — its width in blocks, and which scores `_attend` must
    hide there (None where every query sees every key: masking would change nothing)."""

    index: torch.Tensor
    pieces: list[tuple[int, int]]  # per key block: (rows, blocks)
    hidden: tuple[torch.Tensor | None, ...]  # per key block on CPU: bool [rows, ..., width], True where a query must not look


def key_tiles(tables: torch.Tensor, ends: tuple[int, ...], pool: torch.Tensor, valid: torch.Tensor, *, group: int = 1) -> Reads:
    """tables: [S, P / block_size] of rows whose key counts `ends` are non-increasing, and what their
    queries may see, valid: bool [S, ..., rows, P] laid out as `_attend`'s scores but for each query row
    standing for `group` of them (a chunk's tokens: `_chunk_attention`) → their reads in key blocks of
    KEY_BLOCK positions (the last one shorter) on CPU (`_attend`), one block on CUDA (SDPA, which takes
    the step's mask as it is). A key block holds only the rows with a key in it: a shorter row's sums
    would not change there anyway. Built once a step: no layer inverts, repeats or checks a mask."""
    _blocks, kv_heads, block_size, _dim = pool.shape
    width = tables.shape[1]
    cuda = pool.device.type == "cuda"
    per = width if cuda else KEY_BLOCK // block_size
    parts, pieces, hidden = [], [], []
    for first in range(0, width, per):
        rows = sum(end > first * block_size for end in ends)
        blocks = min(per, width - first)
        parts.append(read_index(tables[:rows, first : first + blocks], kv_heads=kv_heads))
        pieces.append((rows, blocks))
        if not cuda:
            block = valid[:rows, ..., first * block_size : (first + blocks) * block_size]
            hidden.append(None if bool(block.all()) else ~block.repeat_interleave(group, dim=-2))
    return Reads(torch.cat(parts) if len(parts) > 1 else parts[0], pieces, tuple(hidden))


@dataclass(frozen=True, slots=True)
class _Access:
    """What every layer of one step shares: its RoPE tables and where it writes and reads (`_access`)."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [N, 1, head_dim] in the model's dtype
    write: torch.Tensor  # [N * kv_heads] rows of the pool viewed as [-1, head_dim]
    fresh: torch.Tensor  # blocks to zero before the write (their first position is written now)
    decode: Reads | None
    chunks: tuple[Reads, ...]


def _access(w: LlamaWeights, batch: StepBatch, pool: torch.Tensor) -> _Access:
    _blocks, kv_heads, block_size, _dim = pool.shape
    return _Access(
        rope=rope_tables(w, batch.positions, w.embed.dtype),
        write=write_index(batch.write, kv_heads=kv_heads, block_size=block_size).reshape(-1),
        fresh=fresh_blocks(batch.write, block_size=block_size),
        decode=key_tiles(batch.decode_blocks, batch.decode_ends, pool, batch.decode_mask) if batch.decode_blocks is not None and batch.decode_mask is not None else None,
        # a chunk's scores have a row per (token, query head of its kv head): `_chunk_attention`
        chunks=tuple(key_tiles(c.blocks, (c.end,), pool, c.mask[None, None], group=w.heads // w.kv_heads) for c in batch.chunks),
    )


def forward(w: LlamaWeights, batch: StepBatch, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> torch.Tensor:
    """The step's tokens through the model; returns logits [R, vocab] of `batch.sample`'s rows.
    Pools: [num_blocks + 1, kv_heads, block_size, head_dim] per layer (`workers.kv_cache`)."""
    x = w.embed[batch.input_ids]  # [N, hidden]
    access = _access(w, batch, k_pools[0])
    for layer, k_pool, v_pool in zip(w.layers, k_pools, v_pools, strict=True):
        x = x + _attention(w, layer, rms_norm(x, layer.input_norm, w.eps), batch, access, pools=(k_pool, v_pool))
        h = rms_norm(x, layer.post_norm, w.eps)
        gate, up = _project(h, layer.gate_up, None, batch, lora_at=(layer.index, "gate_up")).chunk(2, dim=-1)  # [N, intermediate] each
        x = x + _project(F.silu(gate) * up, layer.down, None, batch, lora_at=(layer.index, "down"))
    last = rms_norm(x[batch.sample], w.norm, w.eps)  # [R, hidden]
    return linear(last, w.lm_head, wide=batch.wide_head)  # [R, vocab]


def weight_shapes(w: LlamaWeights) -> list[tuple[int, int]]:
    """(in, out) of every dense projection a step multiplies by (`workers.kernels.probe_all`)."""
    dense = [m for layer in w.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down) if isinstance(m, torch.Tensor)]
    return [(int(m.shape[1]), int(m.shape[0])) for m in (*dense, w.lm_head)]


def _project(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, batch: StepBatch, *, lora_at: tuple[int, str]) -> torch.Tensor:
    """x [N, in] → [N, out]: the rows `batch.wide` names multiply in float32 (`quant.linear(wide=True)`),
    the others as the weight is stored; then the rows that run an adapter add its delta for projection
    group `lora_at` = (layer, group) (`lora.add_stacked`)."""
    if batch.wide is None or not isinstance(w, torch.Tensor):
        y = linear(x, w, bias)
    elif batch.narrow is None:
        y = linear(x, w, bias, wide=True)
    else:
        y = x.new_empty((x.shape[0], w.shape[0]))
        y.index_copy_(0, batch.narrow, linear(x.index_select(0, batch.narrow), w, bias))
        y.index_copy_(0, batch.wide, linear(x.index_select(0, batch.wide), w, bias, wide=True))
    if batch.lora is not None:
        lora.add_stacked(y, x, batch.lora, layer=lora_at[0], group=lora_at[1])
    return y


def _attention(w: LlamaWeights, layer: Layer, h: torch.Tensor, batch: StepBatch, access: _Access, *, pools: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # h: [N, hidden] → [N, hidden]
    cos, sin = access.rope
    n, d = h.shape[0], w.head_dim
    qkv = _project(h, layer.qkv, layer.qkv_bias, batch, lora_at=(layer.index, "qkv"))  # [N, (heads + 2 * kv_heads) * head_dim]
    q, k, v = qkv.split((w.heads * d, w.kv_heads * d, w.kv_heads * d), dim=-1)
    q, k, v = q.view(n, w.heads, d), k.view(n, w.kv_heads, d), v.view(n, w.kv_heads, d)
    if layer.q_norm is not None and layer.k_norm is not None:
        q, k = rms_norm(q, layer.q_norm, w.eps), rms_norm(k, layer.k_norm, w.eps)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    for pool, new in zip(pools, (k, v), strict=True):
        if access.fresh.numel():
            pool.index_fill_(0, access.fresh, 0)
        pool.view(-1, d).index_copy_(0, access.write, new.reshape(-1, d))  # [N * kv_heads, head_dim]
    out = []
    if batch.decode:
        assert access.decode is not None and batch.decode_mask is not None
        keys, values = (gather(pool, access.decode.index, access.decode.pieces) for pool in pools)
        out.append(_decode_attention(q[: batch.decode], keys, values, batch.decode_mask, hidden=access.decode.hidden))
    for c, reads in zip(batch.chunks, access.chunks, strict=True):
        keys, values = (gather(pool, reads.index, reads.pieces) for pool in pools)
        out.append(_chunk_attention(q[c.offset : c.offset + c.length], keys, values, c.mask, hidden=reads.hidden))
    attn = out[0] if len(out) == 1 else torch.cat(out)  # [N, heads, head_dim]
    return _project(attn.reshape(n, w.heads * d), layer.o, layer.o_bias, batch, lora_at=(layer.index, "o"))


def _decode_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, *, hidden: tuple[torch.Tensor | None, ...]
) -> torch.Tensor:
    # q: [B, heads, head_dim], keys/values: per key block [rows, kv_heads, width, head_dim] (`key_tiles`),
    # mask: [B, 1, 1, P] → [B, heads, head_dim]; each row over its own keys
    b, _heads, dim = q.shape
    kv_heads = keys[0].shape[1]
    grouped = q.view(b, kv_heads, -1, dim)  # [B, kv_heads, group, head_dim]
    if q.device.type == "cuda":
        out = F.scaled_dot_product_attention(grouped, keys[0], values[0], attn_mask=mask)  # one key block: the span
    else:
        out = _attend(grouped, keys, values, hidden)  # [B, kv_heads, group, head_dim]
    return out.reshape(b, -1, dim)


def _chunk_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, *, hidden: tuple[torch.Tensor | None, ...]
) -> torch.Tensor:
    # q: [T, heads, head_dim], keys/values: per key block [1, kv_heads, width, head_dim] (its own already
    # written), mask: [T, P] (SDPA), hidden: per key block (`Reads`, `_attend`) → [T, heads, head_dim]
    t, heads, dim = q.shape
    kv_heads = keys[0].shape[1]
    group = heads // kv_heads
    rows = q.view(t, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, t * group, dim)  # [1, kv_heads, T * group, head_dim]: row t * group + g
    if q.device.type == "cuda":
        valid = mask.repeat_interleave(group, dim=0)[None, None]  # [1, 1, T * group, P]
        out = F.scaled_dot_product_attention(rows, keys[0], values[0], attn_mask=valid)
    else:
        out = _attend(rows, keys, values, hidden)  # [1, kv_heads, T * group, head_dim]
    return out[0].view(kv_heads, t, group, dim).permute(1, 0, 2, 3).reshape(t, heads, dim)


def hf_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (`AttentionInterface`, registered as "metrale" by the runner for
    the hf path on CPU): `_attend` behind any model's own forward, so the hf path too gives a token the
    same attention output whether its prompt came whole, in other chunks or after cached blocks, and
    beside whichever batch mates (torch's CPU SDPA does not: bench/RESULTS.md, sessions 7 and 10).
    query: [B, heads, T, head_dim], key/value: [B, kv_heads, S, head_dim], attention_mask: bool
    [B, 1, T, S] (the runner's, True where a query may look) → [B, T, heads, head_dim]. What `_attend` does
    not do (float or missing masks, a row that cannot see key 0, dropout, soft-capping, sinks, CUDA)
    goes to transformers' SDPA as before."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, t, dim = query.shape
    kv_heads, s = key.shape[1], key.shape[2]
    plain = not kwargs.get("dropout") and kwargs.get("softcap") is None and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None
    mask = attention_mask
    if not plain or query.device.type != "cpu" or mask is None or mask.dtype != torch.bool or mask.shape[1] != 1 or heads % kv_heads or not bool(mask[..., 0].all()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    group, span = heads // kv_heads, key_span(s)
    q = query.reshape(b, kv_heads, group * t, dim)  # row g * T + t: query head (kv head, g) at token t
    keys, values = (F.pad(x, (0, 0, 0, span - s)).split(KEY_BLOCK, dim=2) for x in (key, value))  # per key block [B, kv_heads, width, head_dim]
    valid = F.pad(mask.expand(b, 1, t, s), (0, span - s)).repeat(1, 1, group, 1)  # [B, 1, group * T, span], padding keys unseen
    hidden = tuple(None if bool(block.all()) else ~block for block in valid.split(KEY_BLOCK, dim=-1))
    out = _attend(q, list(keys), list(values), hidden, scale=kwargs.get("scaling"))  # [B, kv_heads, group * T, head_dim]
    return out.reshape(b, heads, t, -1).transpose(1, 2).contiguous(), None


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], hidden: tuple[torch.Tensor | None, ...], *, scale: float | None = None) -> torch.Tensor:
    """Batch- and split-invariant attention on CPU (see the module docstring).

    q: [S, kv_heads, R, head_dim] (R query rows per kv head); keys, values: per key block j (KEY_BLOCK
    positions from j * KEY_BLOCK, the last one shorter) [S_j, kv_heads, width_j, head_dim], the first
    S_j rows of q (`key_tiles`); hidden: per key block, bool broadcastable to [S_j, kv_heads, R, width_j],
    True where a query must not look (key 0 is seen by every row), or None where every row sees every
    key; scale: the softmax scale (1 / sqrt(head_dim) unless the model has its own) → [S, kv_heads, R,
    head_dim]. The matmuls run in `_widen`'s dtype (`_product`, `_weigh`). Per key block: scores in
    float32, the running max, exp, the running sum, and p @ V — from bf16 p where bf16 matmuls are
    native (as transformers' eager attention rounds its probabilities), from float32 p where they run
    in float32 — added in float32. A block a row cannot see would leave its sums exactly as they were
    (exp(-inf) = 0, scale exp(0) = 1), so rows past S_j skip it.

    Passes over the [S_j, kv_heads, R, width] scores are what a long prefill pays for (bench/attention.py),
    so none is spent that changes no bit: a power-of-two scale (head_dim 64, 256) goes into q before
    the matmul, which scales every product and sum exactly; a block every row sees whole is not masked;
    p @ V is added to the float32 sums as it comes (bf16 → float32 is exact)."""
    dtype = q.dtype
    wide = _widen(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    exact = math.frexp(scale)[0] == 0.5
    q = q.to(wide)
    if exact:
        q = q * scale
    peak = total = out = torch.empty(0)
    for j, (k, v, out_of_sight) in enumerate(zip(keys, values, hidden, strict=True)):
        rows = k.shape[0]
        k, v = k.to(wide), v.to(wide)
        scores = _product(q[:rows], k.transpose(-1, -2)).float()  # [S_j, kv_heads, R, width]
        if not exact:
            scores.mul_(scale)
        if out_of_sight is not None:
            scores.masked_fill_(out_of_sight, float("-inf"))
        if j == 0:
            peak = scores.amax(dim=-1, keepdim=True)  # [S, kv_heads, R, 1]
            p = scores.sub_(peak).exp_()
            total, out = p.sum(dim=-1, keepdim=True), _weigh(p if wide == torch.float32 else p.to(dtype), v).float()
            continue
        new_peak = torch.maximum(peak[:rows], scores.amax(dim=-1, keepdim=True))
        rescale = (peak[:rows] - new_peak).exp_()
        p = scores.sub_(new_peak).exp_()
        total[:rows].mul_(rescale).add_(p.sum(dim=-1, keepdim=True))
        out[:rows].mul_(rescale).add_(_weigh(p if wide == torch.float32 else p.to(dtype), v))
        peak[:rows] = new_peak
    return out.div_(total).to(dtype)


def _widen(q: torch.Tensor) -> torch.dtype:
    """The dtype `_attend`'s matmuls run in: the model's, or float32 for bf16 on a CPU without native bf16
    (AVX2 only: oneDNN then emulates bf16, a 512-token chunk's scores took 226 ms against 6 ms in float32).
    The products are the same (a product of two bf16 numbers is exact in float32), and both sum in float32."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and not native_bf16():
        return torch.float32
    return q.dtype


def _weigh(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p @ v, p: [S, kv_heads, R, width], v: [S, kv_heads, width, head_dim] → [S, kv_heads, R, head_dim].
    In float32 MKL sums a product over 256 or 320 keys otherwise than over the same keys followed by zeros
    (AVX2, measured), and a row's value must not depend on how wide its key block was cut (by its batch
    mates' lengths, by its chunk): so a float32 product is made in pieces of WEIGH_KEYS keys, added in
    order, the last piece zero-padded (zeros add exactly nothing); the pieces of a block in one batched
    call. Zero-padding every block to KEY_BLOCK instead cost a 32-row decode block of 200 keys 4.7 ms a
    layer against 1.7 (session 12); a call per piece made a 12,800-key decode row pay for 50 of them."""
    width = p.shape[-1]
    if p.dtype != torch.float32:
        return _product(p, v)
    span = -(-width // WEIGH_KEYS) * WEIGH_KEYS
    if span != width:
        p = F.pad(p, (0, span - width))  # [S, kv_heads, R, span]
        v = F.pad(v, (0, 0, 0, span - width))  # [S, kv_heads, span, head_dim]
    n = span // WEIGH_KEYS
    if n == 1:
        return _product(p, v)
    s, h, r, _ = p.shape
    pieces = p.reshape(s, h, r, n, WEIGH_KEYS).transpose(2, 3)  # [S, kv_heads, n, R, WEIGH_KEYS]
    parts = _product(pieces, v.reshape(s, h, n, WEIGH_KEYS, v.shape[-1]))  # [S, kv_heads, n, R, head_dim]: one call
    out = parts[:, :, 0]
    for i in range(1, n):
        out = out + parts[:, :, i]
    return out


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, a: [..., R, K]. In float32, fewer than FEW_ROWS rows take another MKL kernel than more do,
    with other sums (measured on AVX2: a decode row — R = the query heads per kv head, 3 for SmolLM2 —
    got other scores than the same token in a prefill chunk), so a is padded to FEW_ROWS rows."""
    rows = a.shape[-2]
    if a.dtype != torch.float32 or rows >= FEW_ROWS:
        return torch.matmul(a, b)
    return torch.matmul(F.pad(a, (0, 0, 0, FEW_ROWS - rows)), b)[..., :rows, :]
