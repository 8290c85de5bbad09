"""Prompt logprobs (legacy completions' `echo` with `logprobs`): each prompt token's logprob given the
tokens before it, and the `top` best alternatives at its position.

Owns: turning a prompt's logits into those scores (`scores`), and the hf path's forward for them: one
no-cache forward of the HF model over the whole prompt (`score_prompt`); the lean path runs its own
forward into a cache of the prompt's own (`TorchRunner.score_prompt`). Run once when a request that
asks is admitted (`Engine.add`). The runner's paged KV pool, the scheduler and the batched step are not
involved; the price is one extra prefill of that prompt. Logprobs are the model's raw distribution (no
temperature or penalties), as vLLM reports prompt logprobs.
Must not: touch Redis, the scheduler or the KV pool.
"""

from __future__ import annotations

from typing import Any

import torch

# (logprob of the token, its top alternatives as (id, logprob), best first), for prompt positions 1..L-1
Scored = list[tuple[float, tuple[tuple[int, float], ...]]]  # the engine's `PromptScorer` returns this

CHUNK = 512  # positions turned into fp32 log-softmax at a time: bounds the extra memory to CHUNK x vocab


@torch.inference_mode()
def score_prompt(model: Any, prompt: list[int], top: int, *, device: torch.device) -> Scored:
    """Position i (from 1) scores `prompt[i]` after `prompt[:i]`; the first token has nothing before it."""
    ids = torch.tensor([prompt], device=device)  # [1, L]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # [L-1, vocab]: row i predicts token i+1
    return scores(logits, ids[0, 1:], top)


def scores(logits: torch.Tensor, targets: torch.Tensor, top: int) -> Scored:
    """logits [P, vocab] of P positions, targets [P]: the token each position is followed by."""
    out: Scored = []
    for start in range(0, logits.shape[0], CHUNK):
        logprobs = logits[start : start + CHUNK].float().log_softmax(dim=-1)  # [C, vocab]
        chosen = logprobs.gather(1, targets[start : start + CHUNK, None]).squeeze(1)  # [C]
        values, top_ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [C, top]
        for lp, vs, ts in zip(chosen.tolist(), values.tolist(), top_ids.tolist(), strict=True):
            out.append((lp, tuple(zip(ts, vs, strict=True))))
    return out
