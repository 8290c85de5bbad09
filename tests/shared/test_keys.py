"""Key names: one cluster slot per request (and per shard), `hash_tag` agreeing with Redis Cluster's own rule,
shared hash tags where one Lua script or one XREAD spans several keys, and no two names colliding."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from redis.crc import key_slot

from shared import keys

REQUEST_IDS = ["r1", "chatcmpl-abc123", "0", "a-p1", "x" * 200, "ümlaut", "with{brace}", "with}close", "{"]

PER_REQUEST: list[Callable[[str], str]] = [
    keys.delta_stream,
    keys.request_meta,
    keys.request_ir,
    keys.cancel_flag,
    keys.attachments,
    keys.choices,
]
GLOBAL_NAMES = [
    keys.REQUEST_STREAM,
    keys.WORKER_GROUP,
    keys.INFLIGHT,
    keys.INFLIGHT_BATCH,
    keys.REQUEST_INDEX,
    keys.FINISHED,
    keys.CANCELS,
    keys.DEAD_LETTER,
    keys.WORKERS_ALIVE,
    keys.SEAL_KEY,
    keys.BATCHES_ACTIVE,
]


def slot(key: str) -> int:
    return key_slot(key.encode())


def ids_in_one_shard(count: int) -> list[str]:
    """`count` distinct request ids whose keys land in the same shard."""
    by_shard: dict[int, list[str]] = {}
    for i in itertools.count():
        request_id = f"req-{i}"
        group = by_shard.setdefault(keys.request_shard(request_id), [])
        group.append(request_id)
        if len(group) == count:
            return group
    raise AssertionError("unreachable")


# ---- hash_tag ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "tag"),
    [
        ("plain", "plain"),
        ("a{b}c", "b"),
        ("{req:0a}:r1:deltas", "req:0a"),
        ("a{}b{c}", "a{}b{c}"),  # an empty first tag: the whole key, even with a later one
        ("a{b", "a{b"),  # no closing brace
        ("a}b{c}", "c"),  # a `}` before the first `{` does not count
        ("x{{y}z", "{y"),  # the tag runs from the first `{` to the next `}`
        ("{a}{b}", "a"),
        ("", ""),
    ],
)
def test_hash_tag_is_the_part_between_the_first_brace_pair(key: str, tag: str) -> None:
    assert keys.hash_tag(key) == tag


@pytest.mark.parametrize("key", ["plain", "a{b}c", "a{}b{c}", "a{b", "a}b{c}", "x{{y}z", "{a}{b}", "{}", "}{", "met:ratelimit:{abc}:tokens"])
def test_hash_tag_hashes_to_the_slot_redis_cluster_gives_the_key(key: str) -> None:
    assert slot(keys.hash_tag(key)) == slot(key)


# ---- per-request keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("request_id", REQUEST_IDS)
def test_the_shard_is_one_of_request_shards_and_stable(request_id: str) -> None:
    shard = keys.request_shard(request_id)
    assert 0 <= shard < keys.REQUEST_SHARDS
    assert keys.request_shard(request_id) == shard


def test_request_ids_spread_over_every_shard() -> None:
    shards = {keys.request_shard(f"req-{i}") for i in range(2000)}
    assert shards == set(range(keys.REQUEST_SHARDS))


@pytest.mark.parametrize("request_id", REQUEST_IDS)
def test_every_key_of_a_request_shares_its_shards_hash_tag(request_id: str) -> None:
    tag = f"req:{keys.request_shard(request_id):02x}"
    assert {keys.hash_tag(build(request_id)) for build in PER_REQUEST} == {tag}
    assert {slot(build(request_id)) for build in PER_REQUEST} == {slot(tag)}


@pytest.mark.parametrize("request_id", REQUEST_IDS)
def test_request_keys_lists_the_request_keys_that_expire_together_in_one_slot(request_id: str) -> None:
    listed = keys.request_keys(request_id)
    assert {keys.delta_stream(request_id), keys.request_meta(request_id), keys.request_ir(request_id), keys.cancel_flag(request_id)} <= set(listed)
    assert len(set(listed)) == len(listed)
    assert len({slot(k) for k in listed}) == 1


def test_the_delta_streams_of_one_shard_can_be_read_in_one_xread() -> None:
    streams = [keys.delta_stream(request_id) for request_id in ids_in_one_shard(5)]
    assert len(set(streams)) == 5
    assert len({slot(s) for s in streams}) == 1


def test_a_doorbell_named_by_a_streams_tag_shares_that_streams_slot() -> None:
    stream = keys.delta_stream("r1")
    doorbell = keys.tail_doorbell("node-a", keys.hash_tag(stream))
    assert slot(doorbell) == slot(stream)
    assert keys.tail_doorbell("node-b", keys.hash_tag(stream)) != doorbell  # each node rings its own


def test_the_keys_of_different_requests_never_collide() -> None:
    names = [build(request_id) for request_id in REQUEST_IDS for build in PER_REQUEST]
    assert len(set(names)) == len(names)


def test_no_per_request_key_is_a_global_name() -> None:
    per_request = {build(request_id) for request_id in REQUEST_IDS for build in PER_REQUEST}
    assert per_request.isdisjoint(GLOBAL_NAMES)


# ---- the other families ----------------------------------------------------------------------------------


def test_global_names_are_distinct_and_prefixed() -> None:
    assert len(set(GLOBAL_NAMES)) == len(GLOBAL_NAMES)
    assert all(name.startswith(f"{keys.PREFIX}:") for name in GLOBAL_NAMES)


def test_in_flight_sets_are_the_interactive_and_batch_pools() -> None:
    assert set(keys.IN_FLIGHT_SETS) == {keys.INFLIGHT, keys.INFLIGHT_BATCH} and keys.INFLIGHT != keys.INFLIGHT_BATCH


def test_a_callers_two_rate_buckets_share_one_slot_and_differ() -> None:
    requests, tokens = keys.rate_limit_bucket("c0ffee", "requests"), keys.rate_limit_bucket("c0ffee", "tokens")
    assert requests != tokens
    assert keys.hash_tag(requests) == keys.hash_tag(tokens) == "c0ffee"
    assert keys.rate_limit_bucket("other", "requests") != requests


def test_a_files_meta_and_content_share_one_slot() -> None:
    meta, content = keys.file_meta("file-1"), keys.file_content("file-1")
    assert meta != content and slot(meta) == slot(content)
    assert keys.hash_tag(meta) == "file-1"


def test_every_key_of_a_batch_shares_one_slot() -> None:
    names = [build("batch_7") for build in (keys.batch_doc, keys.batch_lines, keys.batch_results, keys.batch_counts, keys.batch_lease)]
    assert len(set(names)) == len(names)
    assert {keys.hash_tag(name) for name in names} == {"batch_7"}


def test_per_owner_and_per_id_names_differ_by_argument() -> None:
    for build in (keys.files_of, keys.batches_of, keys.worker_info, keys.stored_response):
        assert build("a") != build("b")
        assert build("a").startswith(f"{keys.PREFIX}:")
    assert keys.files_of("a") != keys.batches_of("a")


def test_the_two_cancel_values_are_told_apart() -> None:
    assert keys.CLIENT_CANCEL != keys.OPERATOR_CANCEL
