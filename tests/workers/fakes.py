"""Fakes for torch-free worker tests: a byte-level tokenizer and a scripted runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from models.prompt import ModelInfo
from shared.ir import Message, Protocol, Request, Role, SamplingParams, TextPart
from workers.scheduler import Sampled, Sequence, StepPlan

EOS = 0


class ByteTokenizer:
    """Token id = byte value + 1 (0 is EOS); decoding a partial UTF-8 sequence yields U+FFFD."""

    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 1 for i in ids if i != EOS).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode()]


INFO = ModelInfo(name="fake", max_model_len=256, eos_token_ids=(EOS,), sampling_defaults={})


class ScriptedRunner:
    """Emits each sequence's scripted text byte by byte (then EOS); records every plan it ran."""

    def __init__(self, script: Callable[[Sequence], str], *, num_blocks: int = 64, max_len: int = 256) -> None:
        self.script = script
        self.num_blocks = num_blocks
        self.block_size = 16
        self.max_len = max_len
        self.plans: list[StepPlan] = []
        self.released: list[str] = []

    def execute(self, plan: StepPlan) -> list[Sampled]:
        self.plans.append(plan)
        ready = list(plan.decode) + [c.seq for c in plan.prefill if c.completes_prompt]
        out = []
        for seq in ready:
            text = ByteTokenizer().encode(self.script(seq))
            out.append(Sampled(seq, text[len(seq.output)] if len(seq.output) < len(text) else EOS))
        return out

    def release(self, seq: Sequence) -> None:
        self.released.append(seq.key)


def make_request(rid: str, prompt_len: int = 4, *, priority: int = 0, **sampling: object) -> Request:
    return Request(
        id=rid,
        protocol=Protocol.OPENAI_CHAT,
        model="fake",
        messages=(Message(role=Role.USER, content=(TextPart(text="x"),)),),
        sampling=replace(SamplingParams(temperature=0.0), **sampling),  # type: ignore[arg-type]
        prompt_token_ids=tuple(range(1, prompt_len + 1)),
        priority=priority,
    )


WRONG = ord("~") + 1  # what a VerifyingRunner's row predicts after a guess its script disagrees with


class VerifyingRunner(ScriptedRunner):
    """A ScriptedRunner that checks drafts (speculative decoding) as the lean path does: row i of a draft
    predicts what follows the sequence's output plus the draft's first i guesses, i.e. the script there
    while every guess so far matched it, else WRONG. Asserts the KV invariant on every decoding row: all
    but the last token of prompt + output are computed (what was rolled back was moved past)."""

    verifies = True

    def execute(self, plan: StepPlan) -> list[Sampled]:
        for seq in (*plan.decode, *(d.seq for d in plan.verify)):
            assert seq.computed == seq.length - 1, (seq.key, seq.computed, seq.length)
            assert len(seq.blocks) * self.block_size >= seq.computed + 1
        for d in plan.verify:
            assert len(d.seq.blocks) * self.block_size >= d.seq.computed + d.rows
        out = super().execute(replace(plan, verify=()))
        self.plans[-1] = plan  # recorded as planned, drafts included
        for d in plan.verify:
            text = ByteTokenizer().encode(self.script(d.seq))
            at = len(d.seq.output)
            for i in range(d.rows):
                agreed = all(at + j < len(text) and text[at + j] == d.tokens[j] for j in range(i))
                token = (text[at + i] if at + i < len(text) else EOS) if agreed else WRONG
                out.append(Sampled(d.seq, token))
        return out
