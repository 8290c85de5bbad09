"""Our own forward for the Llama family (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral): plain functions.

Owns: the weights of a loaded transformers model regrouped for one flattened (varlen) step — fused
QKV and gate/up projections — and `forward`, which runs every token of a step (the decode tokens of
all running sequences and this step's prefill chunks) through the model as one [tokens, hidden]
batch, writes each token's keys/values to its pool rows of the paged cache (`workers.kv_cache`), and
reads each sequence's keys/values by its block table. Logits only for the rows that sample.

Attention: the decode rows (one query each) are one batched attention over their gathered, padded
keys/values (the zeroed padding row of the pool, masked out; SDPA on CUDA, two matmuls on CPU); each prefill chunk is one causal SDPA,
over its own fresh keys/values when it starts at position 0, else over its gathered prefix.

Weights come from the HF model's own parameters (so GGUF and safetensors loading stay as they are);
the HF q/k/v and gate/up parameters are re-pointed at views of the fused tensors, so the fused copy
costs no memory and the HF forward (the fallback, and the tests' reference) still works. With
`--quantization int4` the four projections are int4 weights (`workers.quant`), the rest as loaded.

Must not: know sequences or the scheduler (the runner turns a `StepPlan` into a `StepBatch`), or
accept a configuration it does not implement: `unsupported` names why, and the runner then keeps
the generic HF path (other architectures, sliding windows, dynamic/longrope RoPE, non-SiLU MLPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workers.quant import Weight, linear

FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})  # inv_freq fixed at load time


@dataclass(frozen=True, slots=True)
class Layer:
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
    read: torch.Tensor | None  # [start + length] pool rows of positions 0.. (None: start == 0, own keys)
    mask: torch.Tensor | None  # [length, start + length] bool, True where a query may attend


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step, flattened: decode tokens first (one per sequence), then the prefill chunks in order."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    write: torch.Tensor  # [N] pool rows the tokens' keys/values go to
    decode: int  # the first `decode` tokens are decode rows
    decode_read: torch.Tensor | None  # [B, L] pool rows each decode row reads (padding row past its length)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool
    chunks: tuple[Chunk, ...]
    sample: torch.Tensor  # [R] flat indices of the tokens whose logits are sampled


def unsupported(model: Any, *, max_len: int) -> str | None:
    """Why our forward cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        return f"model_type {cfg.model_type!r} is not a Llama-family model"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or not hasattr(model.model, "layers"):
        return "no model.layers / rotary_emb"
    if rotary.rope_type not in STATIC_ROPE:
        return f"RoPE type {rotary.rope_type!r} is not implemented"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    window = getattr(cfg, "sliding_window", None)
    uses_window = cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)
    if window and uses_window and window < max_len:
        return f"sliding window {window} < max_len {max_len}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "layers other than full attention"
    if getattr(model.model.layers[0].mlp.gate_proj, "bias", None) is not None:
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
    for block in inner.layers:
        attn, mlp = block.self_attn, block.mlp
        qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
        gate_up = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        assert qkv is not None and gate_up is not None
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        layers.append(
            Layer(
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


def forward(w: LlamaWeights, batch: StepBatch, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> torch.Tensor:
    """The step's tokens through the model; returns logits [R, vocab] of `batch.sample`'s rows."""
    x = w.embed[batch.input_ids]  # [N, hidden]
    cos, sin = rope_tables(w, batch.positions, x.dtype)  # [N, 1, head_dim]
    for layer, k_pool, v_pool in zip(w.layers, k_pools, v_pools, strict=True):
        x = x + _attention(w, layer, rms_norm(x, layer.input_norm, w.eps), batch, rope=(cos, sin), pools=(k_pool, v_pool))
        h = rms_norm(x, layer.post_norm, w.eps)
        gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)  # [N, intermediate] each
        x = x + linear(F.silu(gate) * up, layer.down)
    last = rms_norm(x[batch.sample], w.norm, w.eps)  # [R, hidden]
    return F.linear(last, w.lm_head)  # [R, vocab]


def _attention(w: LlamaWeights, layer: Layer, h: torch.Tensor, batch: StepBatch, *, rope: tuple[torch.Tensor, torch.Tensor], pools: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # h: [N, hidden] → [N, hidden]; rope: cos, sin [N, 1, head_dim]
    cos, sin = rope
    n, d = h.shape[0], w.head_dim
    qkv = linear(h, layer.qkv, layer.qkv_bias)  # [N, (heads + 2 * kv_heads) * head_dim]
    q, k, v = qkv.split((w.heads * d, w.kv_heads * d, w.kv_heads * d), dim=-1)
    q, k, v = q.view(n, w.heads, d), k.view(n, w.kv_heads, d), v.view(n, w.kv_heads, d)
    if layer.q_norm is not None and layer.k_norm is not None:
        q, k = rms_norm(q, layer.q_norm, w.eps), rms_norm(k, layer.k_norm, w.eps)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k_pool, v_pool = pools
    k_pool.index_copy_(0, batch.write, k)  # [rows, kv_heads, head_dim]
    v_pool.index_copy_(0, batch.write, v)
    out = []
    if batch.decode:
        out.append(_decode_attention(q[: batch.decode], k_pool, v_pool, batch))
    for c in batch.chunks:
        out.append(_chunk_attention(q[c.offset : c.offset + c.length], k[c.offset : c.offset + c.length], v[c.offset : c.offset + c.length], c, k_pool, v_pool))
    attn = out[0] if len(out) == 1 else torch.cat(out)  # [N, heads, head_dim]
    return linear(attn.reshape(n, w.heads * d), layer.o, layer.o_bias)


def _decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    # q: [B, heads, head_dim] → [B, heads, head_dim]; one batched attention over the padded gathered keys
    assert batch.decode_read is not None and batch.decode_mask is not None
    b, length = batch.decode_read.shape
    flat = batch.decode_read.reshape(-1)  # [B * L]
    keys = k_pool.index_select(0, flat).view(b, length, *k_pool.shape[1:])  # [B, L, kv_heads, head_dim]
    values = v_pool.index_select(0, flat).view(b, length, *v_pool.shape[1:])
    if q.device.type == "cuda":
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=batch.decode_mask, enable_gqa=True)
        return out[:, :, 0, :]  # [B, heads, head_dim]
    # On CPU two batched matmuls beat SDPA with a mask several times over (bench notes in bench/RESULTS.md).
    kv_heads, dim = keys.shape[2], keys.shape[3]
    grouped = q.view(b, kv_heads, -1, dim)  # [B, kv_heads, heads / kv_heads, head_dim]
    scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1)).float() * dim**-0.5  # [B, kv_heads, group, L]
    probs = scores.masked_fill(~batch.decode_mask, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, values.transpose(1, 2)).reshape(b, -1, dim)  # [B, heads, head_dim]


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: Chunk, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
    # q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] (this chunk's own) → [T, heads, head_dim]
    # 4-D inputs: with 3-D ones, CPU SDPA takes the math path (≈ 2.5x slower here, bf16, 256 tokens)
    if chunk.read is None:  # the chunk starts the sequence: its own keys are all it attends to
        keys, values, mask = k.transpose(0, 1), v.transpose(0, 1), None
    else:
        keys = k_pool.index_select(0, chunk.read).transpose(0, 1)  # [kv_heads, start + T, head_dim]
        values = v_pool.index_select(0, chunk.read).transpose(0, 1)
        mask = chunk.mask
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return out[0].transpose(0, 1)  # [T, heads, head_dim]
