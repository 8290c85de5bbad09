"""Multi-turn chat sessions for the routing benchmark: the prompts, and the client that plays them.

Owns: each session's system prompt (seeded by the session number: prose, bullet lists and code-like lines
drawn from a word list, its length measured with the model's tokenizer) or one prompt every session shares;
the short user messages; and the closed loop that plays `sessions` sessions, `concurrency` at a time, each
session's turns one after another, through the official `openai` AsyncOpenAI SDK (streaming, greedy,
`stream_options.include_usage`). Each turn sends the whole history: the system prompt, every earlier user
message and the assistant's answer to it as streamed, then the new user message. Per turn: TTFT (first
content chunk), prompt and cached tokens from the usage chunk, the request id (from the chunk id).
Must not: start servers, or loop without a count and time bound.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from openai import AsyncOpenAI
from workloads import single_token_words

PROMPT_TOKENS = (1500, 2000)  # a session's own system prompt, tokens (the model's tokenizer, no template)
SHARED_PROMPT_TOKENS = 2000  # the one system prompt of `shared_prompt` workloads, about
_MAX_PIECE_TOKENS = 60  # a piece of a prompt is at most about this long, so the total lands in range


@dataclass(frozen=True, slots=True)
class Conversations:
    """What every session sends: its system prompt, and its user messages (one a turn)."""

    system_prompts: tuple[str, ...]  # one per session (the same string for a shared prompt)
    system_tokens: tuple[int, ...]  # each prompt's token count (tokenizer, no chat template)
    user_messages: tuple[tuple[str, ...], ...]  # [session][turn]

    @property
    def sessions(self) -> int:
        return len(self.system_prompts)

    @property
    def turns(self) -> int:
        return len(self.user_messages[0]) if self.user_messages else 0


def build(tokenizer: Any, *, sessions: int, turns: int, shared_prompt: bool) -> Conversations:
    words = single_token_words(tokenizer)
    if shared_prompt:
        one = _system_prompt(tokenizer, words, random.Random("shared"), SHARED_PROMPT_TOKENS, label="all sessions")
        prompts = [one] * sessions
    else:
        prompts = []
        for s in range(sessions):
            rng = random.Random(f"session-{s}")
            prompts.append(_system_prompt(tokenizer, words, rng, rng.randint(PROMPT_TOKENS[0], PROMPT_TOKENS[1] - _MAX_PIECE_TOKENS), label=f"session {s}"))
    counts = tuple(_count(tokenizer, p) for p in prompts)
    messages = tuple(tuple(_user_message(words, random.Random(f"user-{s}-{t}"), s, t) for t in range(turns)) for s in range(sessions))
    return Conversations(tuple(prompts), counts, messages)


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _system_prompt(tokenizer: Any, words: list[str], rng: random.Random, target: int, *, label: str) -> str:
    """Pieces of prose, lists and code until the text has `target` tokens (overshooting by one piece at most).
    The first line names the session, so two sessions' prompts part within the first cache block."""
    name = "-".join(rng.choice(words) for _ in range(3))
    pieces = [f"Project {name} ({label}): briefing for the assistant."]
    total = _count(tokenizer, pieces[0])
    while total < target:
        piece = rng.choice((_prose, _bullets, _code))(words, rng)
        pieces.append(piece)
        total += _count(tokenizer, piece) + 1  # the newline between pieces
    return "\n".join(pieces)


def _sentence(words: list[str], rng: random.Random) -> str:
    text = " ".join(rng.choice(words) for _ in range(rng.randint(6, 12)))
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "?", ";"))


def _prose(words: list[str], rng: random.Random) -> str:
    return " ".join(_sentence(words, rng) for _ in range(rng.randint(2, 4)))


def _bullets(words: list[str], rng: random.Random) -> str:
    return "\n".join(f"- {rng.choice(words)} {rng.choice(words)}: {rng.randint(1, 999)} {rng.choice(words)}" for _ in range(rng.randint(2, 4)))


def _code(words: list[str], rng: random.Random) -> str:
    fn, a, b = rng.choice(words), rng.choice(words), rng.choice(words)
    return f"def {fn}_{rng.randint(1, 99)}({a}, {b}_{rng.randint(1, 9)}):\n    return {a} * {rng.randint(2, 64)} + len({b}_{rng.randint(1, 9)})"


def _user_message(words: list[str], rng: random.Random, session: int, turn: int) -> str:
    topic = " ".join(rng.choice(words) for _ in range(rng.randint(5, 9)))
    return f"Session {session}, question {turn + 1}: what does the briefing say about {topic}?"


@dataclass(frozen=True, slots=True)
class Turn:
    """One request as its client saw it (times in seconds from when it was issued)."""

    session: int
    turn: int  # 0-based
    request_id: str  # the server's (the chunk id less "chatcmpl-"); "" if none arrived
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None  # first content chunk; None: no content arrived
    e2e_s: float
    answer: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PlayConfig:
    base_url: str
    model: str
    concurrency: int
    max_tokens: int
    request_timeout_s: float
    timeout_s: float  # the whole run


@dataclass(frozen=True, slots=True)
class Played:
    turns: tuple[Turn, ...]
    wall_s: float
    errors: tuple[str, ...]  # every failed request, and a timeout of the whole run


def play(config: PlayConfig, conversations: Conversations) -> Played:
    return asyncio.run(_play(config, conversations))


async def _play(config: PlayConfig, conversations: Conversations) -> Played:
    client = AsyncOpenAI(base_url=f"{config.base_url}/v1", api_key="unused", max_retries=0, timeout=config.request_timeout_s)
    pending = iter(range(conversations.sessions))
    turns: list[Turn] = []
    errors: list[str] = []

    async def runner() -> None:
        for session in pending:  # shared iterator: `concurrency` sessions at a time
            history: list[dict[str, str]] = [{"role": "system", "content": conversations.system_prompts[session]}]
            for t, message in enumerate(conversations.user_messages[session]):
                history.append({"role": "user", "content": message})
                turn = await _one_turn(client, config, session, t, history)
                turns.append(turn)
                if turn.error is not None:
                    errors.append(f"session {session} turn {t + 1}: {turn.error}")
                    break  # the rest of this session has no history to build on
                history.append({"role": "assistant", "content": turn.answer})

    started = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(runner() for _ in range(config.concurrency))), timeout=config.timeout_s)
    except TimeoutError:
        errors.append(f"run timed out after {config.timeout_s:.0f}s")
    finally:
        await client.close()
    return Played(tuple(sorted(turns, key=lambda t: (t.session, t.turn))), time.perf_counter() - started, tuple(errors))


async def _one_turn(client: AsyncOpenAI, config: PlayConfig, session: int, turn: int, history: list[dict[str, str]]) -> Turn:
    issued = time.perf_counter()
    request_id, ttft, answer = "", None, []
    prompt_tokens = cached = 0
    try:
        stream = await client.chat.completions.create(
            model=config.model,
            messages=list(history),  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            max_tokens=config.max_tokens,
        )
        async for chunk in stream:
            request_id = request_id or chunk.id.removeprefix("chatcmpl-")
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - issued
                answer.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details is not None else 0
    except Exception as exc:
        return Turn(session, turn, request_id, prompt_tokens, cached, ttft, time.perf_counter() - issued, "".join(answer), f"{type(exc).__name__}: {exc}")
    error = None if ttft is not None else "no content chunk received"
    if error is None and not prompt_tokens:
        error = "no usage chunk received"
    return Turn(session, turn, request_id, prompt_tokens, cached, ttft, time.perf_counter() - issued, "".join(answer), error)
