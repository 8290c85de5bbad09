"""Token sampling over a batch of logits, each row with its own parameters (torch).

Greedy rows take the argmax; the others are temperature-scaled, top-k / top-p / min-p filtered
together as [B, vocab] tensors, then drawn with the row's own seeded generator so a seed gives the
same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.ir import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplerRow:
    params: SamplingParams
    generator: torch.Generator | None
    history: list[int]


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> list[int]:
    # logits: [B, vocab] float32
    bias_rows = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    for i, bias in bias_rows:
        ids = torch.tensor([t for t, _ in bias], device=logits.device)
        logits[i, ids] += torch.tensor([b for _, b in bias], device=logits.device)
    greedy = logits.argmax(dim=-1)  # [B]
    sampled_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sampled_idx:
        return greedy.tolist()
    sub = logits[sampled_idx]  # [S, vocab]
    params = [rows[i].params for i in sampled_idx]
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)[:, None]
    probs = filter_probs(torch.softmax(sub / temps, dim=-1), params)
    result = greedy.tolist()
    for j, i in enumerate(sampled_idx):
        result[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator).item())
    return result


def filter_probs(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # probs: [S, vocab]; zero out tokens outside each row's top-k / top-p / min-p set
    device = probs.device
    top_k = torch.tensor([p.top_k if p.top_k and p.top_k > 0 else probs.shape[-1] for p in params], device=device)
    top_p = torch.tensor([p.top_p if p.top_p is not None else 1.0 for p in params], device=device)
    min_p = torch.tensor([p.min_p or 0.0 for p in params], device=device)
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [S, vocab]
    ranks = torch.arange(probs.shape[-1], device=device)[None, :]
    cumulative = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
    keep = (ranks < top_k[:, None]) & (cumulative < top_p[:, None])
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return filtered / filtered.sum(dim=-1, keepdim=True)
