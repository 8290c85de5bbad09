"""The request sets every system under test runs: same prompts, same max_tokens, same arrival order.

Owns: the workload specs (full, --quick, --scale), building user messages of an exact token count
from a seeded word draw, and rendering them with the model's chat template exactly as the server's
`models.prompt.PromptRenderer` does (template as text, then tokenize without special tokens).
Must not: load weights or talk to a server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

# Common words; only those that are one token both with and without a leading space are used, so a
# message of N words is N tokens.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "an",
    "it", "are", "this", "be", "which", "or", "had", "not", "have", "were", "but", "all", "one", "their", "has", "its",
    "new", "first", "been", "more", "who", "also", "after", "two", "time", "would", "she", "other", "into", "can", "people",
    "only", "year", "when", "some", "them", "than", "most", "any", "city", "over", "world", "three", "state", "years",
    "then", "these", "such", "like", "many", "where", "well", "long", "music", "used", "made", "part", "later", "film",
    "team", "war", "while", "life", "school", "work", "both", "under", "each", "because", "early", "through", "high",
    "during", "known", "day", "best", "before", "five", "final", "four", "house", "game", "name", "water", "light", "power",
    "river", "small", "great", "field", "road", "north", "south", "east", "west", "green", "black", "white", "red", "blue",
    "stone", "paper", "table", "window", "garden", "market"
)

SEED = 0


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What a workload draws: `num_requests` requests run by `concurrency` closed-loop clients."""

    name: str
    concurrency: int
    num_requests: int
    message_tokens: tuple[int, int]  # inclusive range of the user message's token count
    max_tokens: tuple[int, int]  # inclusive range of max_tokens (every request generates exactly this)
    same_prompt: bool = False  # every request sends the same message
    shared_prefix: int = 0  # tokens of one message prefix every request starts with (then its own message_tokens)


FULL = {
    "uniform": WorkloadSpec("uniform", concurrency=32, num_requests=32, message_tokens=(64, 64), max_tokens=(128, 128), same_prompt=True),
    "mixed": WorkloadSpec("mixed", concurrency=32, num_requests=128, message_tokens=(16, 1024), max_tokens=(16, 512)),
    "single": WorkloadSpec("single", concurrency=1, num_requests=8, message_tokens=(64, 64), max_tokens=(128, 128), same_prompt=True),
    "prefix": WorkloadSpec("prefix", concurrency=1, num_requests=16, message_tokens=(50, 50), max_tokens=(16, 16), shared_prefix=4000),
}

QUICK = {
    "uniform": WorkloadSpec("uniform", concurrency=8, num_requests=8, message_tokens=(64, 64), max_tokens=(32, 32), same_prompt=True),
    "mixed": WorkloadSpec("mixed", concurrency=8, num_requests=16, message_tokens=(16, 256), max_tokens=(16, 64)),
    "single": WorkloadSpec("single", concurrency=1, num_requests=3, message_tokens=(64, 64), max_tokens=(32, 32), same_prompt=True),
    "prefix": WorkloadSpec("prefix", concurrency=1, num_requests=4, message_tokens=(50, 50), max_tokens=(8, 8), shared_prefix=1000),
}


def spec_for(name: str, *, quick: bool, scale: float) -> WorkloadSpec:
    """The spec to run; `scale` multiplies the request count (never below one request per client)."""
    spec = (QUICK if quick else FULL)[name]
    if scale == 1.0:
        return spec
    return replace(spec, num_requests=max(spec.concurrency, round(spec.num_requests * scale)))


@dataclass(frozen=True, slots=True)
class BenchRequest:
    index: int  # arrival order
    message: str  # the single user message
    message_tokens: int
    prompt_ids: tuple[int, ...]  # the chat-templated prompt, as the server renders it
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    requests: tuple[BenchRequest, ...]

    @property
    def useful_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def describe(self) -> str:
        prompts = [len(r.prompt_ids) for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return (
            f"{self.spec.name}: {len(self.requests)} requests, {self.spec.concurrency} clients, "
            f"prompt tokens {min(prompts)}-{max(prompts)} (mean {sum(prompts) / len(prompts):.0f}, chat template included), "
            f"max_tokens {min(outs)}-{max(outs)} (total {sum(outs)})"
        )


def build(spec: WorkloadSpec, tokenizer: Any) -> Workload:
    rng = random.Random(SEED)
    words = single_token_words(tokenizer)
    fixed = _message(tokenizer, words, rng, spec.message_tokens[0]) if spec.same_prompt else None
    prefix = _message(tokenizer, words, rng, spec.shared_prefix) + " " if spec.shared_prefix else ""
    requests = []
    for index in range(spec.num_requests):
        message = fixed or prefix + _message(tokenizer, words, rng, rng.randint(*spec.message_tokens))
        max_tokens = rng.randint(*spec.max_tokens)
        count = len(tokenizer(message, add_special_tokens=False)["input_ids"])
        requests.append(BenchRequest(index, message, count, tuple(render(tokenizer, message)), max_tokens))
    return Workload(spec, tuple(requests))


def single_token_words(tokenizer: Any) -> list[str]:
    def one_token(text: str) -> bool:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1

    words = sorted({w for w in _WORDS if one_token(w) and one_token(" " + w)})
    if len(words) < 20:
        raise RuntimeError(f"only {len(words)} single-token words for this tokenizer; extend _WORDS")
    return words


def _message(tokenizer: Any, words: list[str], rng: random.Random, num_tokens: int) -> str:
    message = " ".join(rng.choice(words) for _ in range(num_tokens))
    count = len(tokenizer(message, add_special_tokens=False)["input_ids"])
    if count != num_tokens:
        raise RuntimeError(f"built a message of {count} tokens, wanted {num_tokens}")
    return message


def render(tokenizer: Any, message: str) -> list[int]:
    """The prompt ids the server sends to its worker for this single user message."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids
