"""bus.connect: which client a URL gets, how a cluster URL is read (no server needed), and that a
client rides out a Redis restart (a real redis-server)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis, RedisCluster

from bus.connect import cluster_options, connect, is_cluster_url
from cli.embedded_redis import EmbeddedRedis
from shared.settings import Settings


def test_a_plain_url_gets_the_single_server_client_and_a_cluster_url_the_cluster_client() -> None:
    assert type(connect("redis://127.0.0.1:6379/0")) is Redis
    assert isinstance(connect("redis+cluster://127.0.0.1:7000"), RedisCluster)
    assert is_cluster_url("rediss+cluster://h:1") and not is_cluster_url("rediss://h:1")


def test_a_cluster_url_names_every_seed_node_and_its_credentials() -> None:
    options = cluster_options("rediss+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2:7001/0")
    assert [(n.host, n.port) for n in options["startup_nodes"]] == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert options["password"] == "s@cret" and options["username"] == "app" and options["ssl"] is True


def test_a_cluster_url_with_another_database_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="only database 0"):
        cluster_options("redis+cluster://127.0.0.1:7000/3")


def test_redis_cluster_setting_spells_the_url_as_a_cluster_url() -> None:
    settings = Settings(redis_url="redis://:pw@r1:6379/0", redis_cluster=True).cluster_url()
    assert settings.redis_url == "redis+cluster://:pw@r1:6379/0"
    assert Settings(redis_url="redis://r1:6379").cluster_url().redis_url == "redis://r1:6379"
    assert Settings.from_env({"MET_REDIS_CLUSTER": "1", "REDIS_URL": "redis://r1:1"}).cluster_url().redis_url == "redis+cluster://r1:1"


@pytest.mark.redis
def test_a_client_whose_pooled_connection_died_in_a_redis_restart_answers_its_next_command(tmp_path: Path) -> None:
    """The API's first request after a Redis restart got a 503: its pooled connection was dead and
    redis-py's from_url retries nothing. Every role's client now reconnects once (bus.connect.quick_retry)."""
    server = EmbeddedRedis(str(tmp_path))
    url = server.start()

    async def scenario() -> bytes | None:
        redis = connect(url)
        try:
            await redis.set("k", "v")  # one pooled connection, idle from here
            assert server.proc is not None
            server.proc.kill()  # kill -9; the AOF keeps the key
            server.proc.wait()
            await asyncio.to_thread(server.start)  # same port
            return await redis.get("k")
        finally:
            await redis.aclose()

    try:
        assert asyncio.run(scenario()) == b"v"
    finally:
        server.stop()


def test_a_busy_pool_makes_commands_wait_for_a_connection_instead_of_failing(redis_server: str) -> None:
    """redis-py's default pool raised at once past its size (an API node failed past ~100 open
    streams); ours waits. 40 commands that each hold a connection for 0.2 s share 4 connections."""

    async def scenario() -> tuple[int, int]:
        redis = connect(redis_server, max_connections=4)
        replies = await asyncio.gather(*(redis.blpop([f"nothing-{i}"], timeout=0.2) for i in range(40)))
        pool: Any = redis.connection_pool
        made = len(pool._available_connections) + len(pool._in_use_connections)
        await redis.aclose()
        return len(replies), made

    done, made = asyncio.run(scenario())
    assert done == 40 and made == 4


def test_commands_are_packed_by_hiredis_as_redis_py_would_send_them(redis_server: str) -> None:
    """Every argument type the code sends reads back as redis-py's own packing stores it (floats as their
    shortest repr), and what redis-py refuses (bool, None) is refused the same way."""
    from redis.asyncio.connection import Connection
    from redis.exceptions import DataError

    from bus.connect import HiredisPacked

    values: list[object] = [b"\x00bytes", "text é", 7, -3, 0.1, 1733333333.123456, 2.5e-08, bytearray(b"ba"), memoryview(b"mv")]
    args = ("HSET", "h", *[x for i, v in enumerate(values) for x in (f"f{i}", v)])
    assert b"".join(HiredisPacked().pack_command(*args)) == b"".join(Connection().pack_command(*args))

    async def scenario() -> dict[bytes, bytes]:
        redis = connect(redis_server)
        await redis.delete("packed")
        await redis.hset("packed", mapping={f"f{i}": v for i, v in enumerate(values)})  # type: ignore[misc]
        for bad in (True, None):
            with pytest.raises(DataError):
                await redis.set("bad", bad)  # type: ignore[arg-type]
        stored: dict[bytes, bytes] = await redis.hgetall("packed")
        await redis.aclose()
        return stored

    stored = asyncio.run(scenario())
    assert stored[b"f4"] == b"0.1" and stored[b"f5"] == b"1733333333.123456" and stored[b"f1"] == "text é".encode()
