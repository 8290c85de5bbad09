"""The simulated engine's runner (`--model-impl sim`): the worker, its scheduler and its engine as they
are, the model's forward replaced by a wait of `--sim-step-ms` per step.

For load: with a real model the pipeline's own cost (claims, detokenization, fenced writes, the API
node's tails and encoders) hides behind the forward on a CPU, and on a GPU the forward is time the
worker's CPU does not spend. The wait here is that GPU time: it holds no CPU and no GIL (it sleeps on
the torch thread, as a CUDA sync would), so a worker's CPU figures are the pipeline's alone, and one
worker can stand in for a GPU running batches of hundreds (llm-d's inference simulator is the
precedent). No weights are loaded: only the model folder's tokenizer and config (the default model's
when `--model` is not given).

What it generates: a fixed English text's token ids, from a point of the text chosen by the prompt and
advanced by the output's length, so greedy and seeded requests alike get the same tokens alone, in a
batch, preempted or resumed (the exactly-once machinery behaves as with a model). It never emits an
end-of-sequence token: every request runs to its `max_tokens` (or a stop string in the text). Sampling
parameters, logprobs and output constraints are not simulated (a constrained request ends with the
engine's error for a token its grammar refuses).

Must not: import torch (a simulated worker never loads it).
"""

from __future__ import annotations

import time
from typing import Any

from workers.blocks import BLOCK_SIZE
from workers.scheduler import Sampled, Sequence, StepPlan

TEXT = (
    "The keeper climbed the stairs of the lighthouse every evening at dusk, carrying a lamp and a small book of tides. "
    "From the gallery he could see the harbour, the fishing boats coming home, and the long line of the coast running "
    "north into the mist. Storms came in the autumn, and on those nights he stayed awake until morning, watching the "
    "light turn and listening to the sea break against the rocks below. "
)
SIM_KV_TOKENS = 1 << 20  # positions in the simulated pool: block accounting works as with a model, and never binds first


class SimRunner:
    """A `workers.engine.Runner` whose step waits `step_s` and samples from `TEXT`'s token ids."""

    block_size = BLOCK_SIZE
    lean = None
    quantization = "none"
    wide_mode = "off"
    kv_bytes = 0

    def __init__(self, tokenizer: Any, *, max_len: int, step_s: float) -> None:
        self.max_len = max_len
        self.step_s = step_s
        self.num_blocks = SIM_KV_TOKENS // BLOCK_SIZE
        self._text = tuple(tokenizer.encode(TEXT, add_special_tokens=False))

    def execute(self, plan: StepPlan) -> list[Sampled]:
        if self.step_s > 0:
            time.sleep(self.step_s)  # the forward's time on an accelerator: no CPU, no GIL
        rows = [*plan.decode, *(c.seq for c in plan.prefill if c.completes_prompt)]
        return [Sampled(seq, self.next_token(seq)) for seq in rows]

    def next_token(self, seq: Sequence) -> int:
        """The token after `seq`'s output so far: a pure function of its prompt and output length."""
        start = sum(seq.prompt[-8:]) % len(self._text)
        return self._text[(start + len(seq.output)) % len(self._text)]

    def release(self, seq: Sequence) -> None:
        return None
