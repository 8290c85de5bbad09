"""One way to open Redis for every role: a single server or a Redis Cluster, from one URL.

- `redis://`, `rediss://`, `unix://`: one server (redis-py's `Redis`).
- `redis+cluster://[user:password@]host:port[,host:port...]` (`rediss+cluster://` for TLS), or any
  redis URL with `--redis-cluster` / `MET_REDIS_CLUSTER=1`: redis-py's `RedisCluster`, seeded from
  those nodes (it discovers the rest and follows MOVED / ASK on resharding and failover).

Cluster rules the code keeps (audited; see docs/deployment.md, "Redis Cluster"):
- every Lua script and MULTI/EXEC touches one hash slot: the per-request keys share their shard's `{req:<shard>}`, a
  caller's rate buckets `{<caller>}`, a batch's keys `{<batch id>}`, a file's `{<file id>}`;
- a non-transactional pipeline may span slots, but redis-py sends each node's share concurrently, so
  no order holds between slots: where order matters (ingest.http.publish) it is two round trips;
- XREAD / XREADGROUP read one stream at a time.

The global keys (the request stream and its consumer group, the in-flight counter, the finished feed,
the alive set, the request index) each live in one slot: they are the cluster's hot keys. One slot
carries them at the rates one model server produces (a few XADDs per request, not per token); the
per-token traffic (the delta streams) spreads over every slot. They are not sharded.

`RedisCluster` is not a subclass of `Redis` but answers the same commands this code uses, so
`connect` is typed as `Redis` for its callers.

Every client retries a command once, quickly, on a connection error (`quick_retry`). redis-py's
`from_url` retries nothing, so after a Redis restart the first command on each pooled connection (dead
since the restart, still in the pool) failed: the API answered its first request after an outage with
a 503. One retry reconnects it; a longer outage each role rides out itself (bus.tails, workers.claims).

A single server's pool has an explicit size (`max_connections`, `--redis-max-connections`) and a
command that finds every connection busy waits for one (redis-py's `BlockingConnectionPool`) instead of
failing at once (its default pool raised past 100, which took an API node down past ~100 open
streams). Waiting streams hold no connection (bus.tails), so the pool is sized for commands in
progress, not for clients. A cluster client keeps redis-py's per-node pools (created as needed).

Commands are packed by hiredis in C (`HiredisPacked`): redis-py's asyncio connection packs every
argument in Python (~1.6 ms for an XREAD over 1,024 streams, 0.2 ms with hiredis; a step's fenced
writes likewise), and redis-py uses hiredis's packer only in its synchronous client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import DataError

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DEFAULT_MAX_CONNECTIONS = 64  # a single server's pool per process (--redis-max-connections)


def _pack(args: tuple[Any, ...]) -> list[bytes]:
    """One command in RESP, packed by hiredis. Floats go as Python's shortest repr (what redis-py's own
    encoder sends: stored timestamps read back the same); bytearray / memoryview as bytes."""
    if isinstance(args[0], str) and " " in args[0]:  # redis-py spells some commands as one string ("CLIENT ID")
        args = (*args[0].split(), *args[1:])
    try:
        return [hiredis.pack_command(tuple(_arg(a) for a in args))]
    except TypeError as exc:
        raise DataError(str(exc)) from None


def _arg(value: Any) -> Any:
    kind = type(value)
    if kind is bytes or kind is str or kind is int:
        return value
    if kind is float:
        return repr(value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, bool) or value is None:
        raise DataError(f"Invalid input of type: {type(value).__name__!r}. Convert to a bytes, string, int or float first.")
    return value


class _HiredisPacking:
    def pack_command(self, *args: Any) -> list[bytes]:
        return _pack(args)

    def pack_commands(self, commands: Any) -> list[bytes]:
        return [b"".join(_pack(tuple(cmd))[0] for cmd in commands)]


class HiredisPacked(_HiredisPacking, Connection):
    """redis-py's asyncio TCP connection, commands packed by hiredis."""


class HiredisPackedSSL(_HiredisPacking, SSLConnection):
    """... over TLS."""


class HiredisPackedUnix(_HiredisPacking, UnixDomainSocketConnection):
    """... over a Unix socket."""


_PACKED = {Connection: HiredisPacked, SSLConnection: HiredisPackedSSL, UnixDomainSocketConnection: HiredisPackedUnix}


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def is_cluster(redis: Any) -> bool:
    """Whether `redis` (as `connect` made it) talks to a Redis Cluster."""
    return isinstance(redis, RedisCluster)


def quick_retry() -> Retry:
    """One retry after 50 ms: enough to replace a connection the server closed, short enough that a
    role which steps on through an outage (the worker) does not stall on each command."""
    return Retry(ExponentialBackoff(cap=0.2, base=0.05), 1)


def connect(url: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS, **options: Any) -> Redis:
    """An asyncio client for `url`: a cluster client for a `+cluster` URL (`--redis-cluster` turns a
    plain URL into one: shared.settings.Settings.cluster_url). `options` go to either client (e.g. the
    worker's `socket_connect_timeout`); `retry` defaults to `quick_retry()`. A single server's pool
    holds at most `max_connections`, and a command waits for a free one (no timeout: each command
    has its socket's own)."""
    options.setdefault("retry", quick_retry())
    if not is_cluster_url(url):
        pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=None, **options)
        pool.connection_class = _PACKED.get(pool.connection_class, pool.connection_class)
        return Redis.from_pool(pool)
    return cast(Redis, _packed_cluster(RedisCluster(**cluster_options(url), **options)))


def _packed_cluster(client: RedisCluster) -> RedisCluster:
    """The cluster client's connections packed by hiredis too: RedisCluster takes no connection class, so
    the one its node kwargs name (and its startup nodes were made with) is swapped before any connects."""
    kwargs = client.nodes_manager.connection_kwargs
    packed = _PACKED.get(kwargs["connection_class"], kwargs["connection_class"])
    kwargs["connection_class"] = packed
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = packed
    return client


def cluster_options(url: str) -> dict[str, Any]:
    """RedisCluster's keyword arguments for a (possibly multi-host) cluster URL."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme, parts.scheme)
    if scheme not in ("redis", "rediss"):
        raise ValueError(f"{parts.scheme}:// cannot name a Redis Cluster: use redis+cluster://host:port")
    if parts.path not in ("", "/", "/0"):
        raise ValueError("a Redis Cluster has only database 0: drop the /<db> from the URL")
    credentials, _, hosts = parts.netloc.rpartition("@")
    user, _, password = credentials.partition(":") if credentials else ("", "", "")
    nodes = [_node(h) for h in hosts.split(",") if h]
    if not nodes:
        raise ValueError(f"no host in the Redis Cluster URL {scheme}://…")
    options: dict[str, Any] = {"startup_nodes": nodes, "ssl": scheme == "rediss"}
    if password:
        options["password"] = unquote(password)
    if user:
        options["username"] = unquote(user)
    return options


def _node(host_port: str) -> ClusterNode:
    host, _, port = host_port.rpartition(":") if ":" in host_port else (host_port, "", "6379")
    return ClusterNode(host.strip("[]"), int(port))


def queue_script(pipe: Any, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any], *, loaded: bool = False) -> None:
    """Queue `script` on a pipeline of either client. A standalone pipeline runs it by its hash
    (EVALSHA); unless the caller knows the server has it (`loaded`: an earlier pipeline ran it, and
    no NoScriptError since), the pipeline first checks and loads it, which costs one more round trip
    (redis-py's SCRIPT EXISTS at every execute). A cluster pipeline cannot rely on either (the script
    may be missing on the node the slot lives on), so it sends the body (EVAL), which every node accepts."""
    if isinstance(pipe, Pipeline):
        if not loaded:
            pipe.scripts.add(cast(Any, script))  # typed as the sync Script; the async pipeline holds AsyncScripts
        pipe.evalsha(script.sha, len(keys), *keys, *args)
    else:
        pipe.eval(script.script, len(keys), *keys, *args)
