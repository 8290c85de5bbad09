"""One layer's attention, ours (`workers.llama`'s batch-invariant CPU attention) against torch's SDPA (what
the hf path runs), on the same inputs, side by side: ms per call and the ratio.

Owns: the shapes (SmolLM2's geometry by default: 9 heads, 3 kv heads, 64 dims), building keys/values as
the lean path reads them (key blocks of `llama.KEY_BLOCK`, spans cut at `llama.key_span`), and timing.
Must not: load a model or a server; the full pipeline is bench/throughput.py, one step is step_profile.py.

    python bench/attention.py                      # default threads, as a worker runs
    python bench/attention.py --threads 1          # a footnote, not the headline
    python bench/attention.py --key-block 2048     # another online-softmax block width (an experiment)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers import llama

# (kind, queries: prefill tokens or decode rows, keys: each query's context)
SHAPES = (
    ("prefill", 512, 512),
    ("prefill", 512, 4096),
    ("prefill", 512, 8192),
    ("prefill", 64, 4096),
    ("decode", 1, 128),
    ("decode", 1, 4096),
    ("decode", 1, 12800),
    ("decode", 32, 256),
    ("decode", 32, 1024),
)


def _blocks(x: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """x: [S, kv_heads, P, dim] → per key block of KEY_BLOCK positions, its first `rows[j]` rows."""
    return [x[: rows[j], :, start : start + llama.KEY_BLOCK].contiguous() for j, start in enumerate(range(0, x.shape[2], llama.KEY_BLOCK))]


def _hidden(valid: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """What `llama.key_tiles` hides per key block of a mask laid out as the scores."""
    return tuple(None if bool(b.all()) else ~b for b in valid.split(llama.KEY_BLOCK, dim=-1))


def _time(fn: object, repeats: int) -> float:
    assert callable(fn)
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def case(kind: str, queries: int, keys: int, *, geometry: tuple[int, int, int], repeats: int) -> tuple[float, float]:
    """(ours ms, SDPA ms) for one call; prefill: one chunk of `queries` tokens ending at position `keys`;
    decode: `queries` rows of one token each, all `keys` long. geometry: (heads, kv_heads, head_dim)."""
    heads, kv_heads, dim = geometry
    gen = torch.Generator().manual_seed(0)
    span = llama.key_span(keys)
    seqs = 1 if kind == "prefill" else queries
    k, v = (torch.randn(seqs, kv_heads, span, dim, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(queries, heads, dim, generator=gen).bfloat16()
    rows = [seqs] * len(range(0, span, llama.KEY_BLOCK))
    blocks = (_blocks(k, rows), _blocks(v, rows))
    if kind == "prefill":
        mask = torch.arange(span)[None, :] <= torch.arange(keys - queries, keys)[:, None]  # [T, P]
        hidden = _hidden(mask.repeat_interleave(heads // kv_heads, dim=0)[None, None])  # laid out as the scores

        def ours() -> None:
            llama._chunk_attention(q, *blocks, mask, hidden=hidden)

        sdpa_q, sdpa_k, sdpa_v, sdpa_mask = q.transpose(0, 1)[None], k, v, mask[None, None]
    else:
        mask = (torch.arange(span)[None, :] < keys)[:, None, None, :].expand(queries, 1, 1, span)  # [B, 1, 1, P]
        hidden = _hidden(mask)

        def ours() -> None:
            llama._decode_attention(q, *blocks, mask, hidden=hidden)

        sdpa_q, sdpa_k, sdpa_v, sdpa_mask = q[:, :, None, :], k, v, mask

    def sdpa() -> None:
        F.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, attn_mask=sdpa_mask, enable_gqa=True)

    return _time(ours, repeats), _time(sdpa, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as a worker runs)")
    parser.add_argument("--repeats", type=int, default=7, help="the best of this many calls is reported")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--key-block", type=int, default=llama.KEY_BLOCK, help="keys per online-softmax block (an experiment: the server uses llama.KEY_BLOCK)")
    args = parser.parse_args(argv)
    llama.KEY_BLOCK = args.key_block
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.heads} heads / {args.kv_heads} kv heads / {args.dim} dims, key blocks of {llama.KEY_BLOCK}, best of {args.repeats}")
    print("| call | queries | keys | ours ms | SDPA ms | ours / SDPA |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for kind, queries, keys in SHAPES:
            ours, sdpa = case(kind, queries, keys, geometry=(args.heads, args.kv_heads, args.dim), repeats=args.repeats)
            print(f"| {kind} | {queries} | {keys:,} | {ours:.2f} | {sdpa:.2f} | {ours / sdpa:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
