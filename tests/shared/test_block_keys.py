"""The routing contract between an API node and a worker: `shared.block_keys.prompt_keys` names exactly the
blocks the worker's scheduler keys for the same prompt and would take from its prefix cache (salted or not),
never the block holding the last prompt token (a worker always computes that one)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.block_keys import BLOCK_SIZE, index_key, prompt_keys
from workers.blocks import BlockPool
from workers.scheduler import Scheduler, Sequence

from ..workers.fakes import make_request


def scheduled_keys(tokens: list[int], *, cache_salt: str = "", block_size: int = BLOCK_SIZE, salt_outputs: bool = False) -> list[bytes]:
    """The keys the scheduler looks up when it admits the prompt (its usable full blocks), read off the sequence."""
    pool = BlockPool(64, block_size=block_size)
    scheduler = Scheduler(pool=pool, max_running=4, max_tokens_per_step=4096, salt_outputs=salt_outputs)
    request = replace(make_request("r"), prompt_token_ids=tuple(tokens), cache_salt=cache_salt)
    seq = Sequence(request, list(tokens))
    scheduler.add(seq)
    plan = scheduler.schedule()
    assert plan.prefill and plan.prefill[0].seq is seq
    return list(seq.block_keys)


def prefilled_keys(tokens: list[int], *, cache_salt: str = "", salt_outputs: bool = False) -> tuple[list[bytes], BlockPool]:
    """The keys the worker's pool holds after it prefilled the prompt (what its routing index publishes)."""
    pool = BlockPool(64)
    scheduler = Scheduler(pool=pool, max_running=4, max_tokens_per_step=4096, salt_outputs=salt_outputs)
    request = replace(make_request("r"), prompt_token_ids=tuple(tokens), cache_salt=cache_salt)
    seq = Sequence(request, list(tokens))
    scheduler.add(seq)
    scheduler.advance(scheduler.schedule())
    return pool.cached_keys(), pool


@pytest.mark.parametrize("length", [1, 15, 16, 17, 32, 33, 100, 160, 161])
@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_prompt_keys_are_the_keys_the_scheduler_looks_up_on_admission(length: int, salt: str) -> None:
    tokens = [(7 * i + 3) % 50_000 for i in range(length)]
    expected = scheduled_keys(tokens, cache_salt=salt)
    assert prompt_keys(tokens, cache_salt=salt) == expected
    assert len(expected) == (length - 1) // BLOCK_SIZE  # the block holding the last prompt token is never usable


@pytest.mark.parametrize("salt_outputs", [False, True])
def test_a_second_request_with_the_same_prefix_finds_every_block_prompt_keys_names(salt_outputs: bool) -> None:
    """The API node's overlap (prompt_keys against the worker's cached keys) is what the worker then reuses."""
    first = list(range(1, 100))  # 6 full blocks + 3 tokens
    cached, pool = prefilled_keys(first, salt_outputs=salt_outputs)
    follow_up = [*first, *range(500, 540)]
    wanted = prompt_keys(follow_up)
    held = 0
    for key in wanted:
        if key not in cached:
            break
        held += 1
    assert held == len(first) // BLOCK_SIZE == 6
    assert len(pool.lookup(wanted)) == held  # the worker's own lookup agrees


def test_the_salt_separates_keys_and_the_same_salt_matches() -> None:
    tokens = list(range(1, 70))
    plain, a, a_again, b = (prompt_keys(tokens, cache_salt=s) for s in ("", "a", "a", "b"))
    assert a == a_again == scheduled_keys(tokens, cache_salt="a")
    assert not set(plain) & set(a) and not set(a) & set(b)
    cached, _ = prefilled_keys(tokens, cache_salt="a")
    assert set(a) <= set(cached) and not set(plain) & set(cached)


def test_another_block_size_and_a_limit() -> None:
    tokens = list(range(1, 200))
    assert prompt_keys(tokens, block_size=32) == scheduled_keys(tokens, block_size=32)
    assert prompt_keys(tokens, limit=3) == prompt_keys(tokens)[:3]
    assert prompt_keys([]) == [] and prompt_keys(list(range(16))) == []


def test_index_keys_are_prefixes_of_the_full_keys() -> None:
    keys = prompt_keys(list(range(1, 50)))
    assert [index_key(k) for k in keys] == [k[:8] for k in keys] and len(set(map(index_key, keys))) == len(keys)
