"""bus.connect: which client a URL gets, how a cluster URL is read (no server needed), and that a
client rides out a Redis restart (a real redis-server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
