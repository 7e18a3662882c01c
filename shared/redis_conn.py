"""Redis clients from a URL (AUTH, ACL users and TLS come from the URL itself).

The URL may name a single Redis or any node of a Redis Cluster (or Valkey cluster): which one
is found by asking the server (``INFO cluster``) once per URL, and a cluster gets redis-py's
cluster client, which follows MOVED / ASK redirections and re-reads the slot map after a
failover. Commands are retried a few times with exponential backoff on connection errors,
which rides out a brief network blip, a Redis restart or a failover; longer outages are handled
by the loops that use the client (they back off and keep going). Every command lmpool sends is
safe to repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis as sync_redis
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.errors import PoolUnreachable

TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
    OSError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
    ReadOnlyError,
    ClusterError,
)
"""Errors that mean "Redis is unreachable right now" (a server restarting, a cluster failing
over: a replica not yet promoted answers CLUSTERDOWN or READONLY; a slot moving between
nodes: redis-py gives up on its ASK / TRYAGAIN redirections with ``ClusterError('TTL
exhausted.')``), as opposed to a refused command: loops back off and try again."""


AnyRedis = Redis | RedisCluster
"""A client of a single Redis or of a cluster: lmpool's code works with either."""
_CLUSTER: dict[str, bool] = {}
"""What each URL named, once asked: a cluster (True) or a single server."""


def masked_url(url: str) -> str:
    """``url`` with its password shown as ``***`` (in the user part and a ``password=``
    query parameter): what log lines and error messages may print. A password holding a
    character that ends a URL's host part (``/``, ``?``, ``#``: not percent-encoded) is masked
    too, with all else before the last ``@``."""
    if _raw_credentials(url):
        scheme, _, rest = url.partition("://")
        auth, _, host = rest.rpartition("@")
        user = auth.partition(":")[0]
        bare = f"{scheme}://{'' if any(c in user for c in '/?#') else user}:***@{host}"
        return bare if _raw_credentials(bare) else masked_url(bare)
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        auth, _, host = netloc.rpartition("@")
        netloc = f"{auth.partition(':')[0]}:***@{host}"
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k == "password" for k, _ in pairs):
        query = urlencode([(k, "***" if k == "password" else v) for k, v in pairs], safe="*/")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _raw_credentials(url: str) -> bool:
    """Whether ``url``'s user part holds a ``/``, ``?`` or ``#`` (a password not
    percent-encoded): URL parsers then take part of it for the host, port, path or query. An
    ``@`` may stand elsewhere only in a query's value (a file's path), or a unix socket's path."""
    parts = urlsplit(url)
    if "://" not in url or "@" in parts.netloc or "@" not in url:
        return False
    if parts.scheme == "unix":
        return bool(parts.netloc)
    if "@" in parts.path or "@" in parts.fragment:
        return True
    return any("@" in pair.partition("=")[0] for pair in parts.query.split("&"))


def check_url(url: str) -> str:
    """``url``, or ``ValueError`` (not naming the password) where its password is not
    percent-encoded: redis-py would read part of it as the port or the path, and say so in
    its error, the password in the message."""
    if _raw_credentials(url):
        raise ValueError(
            "its password holds '/', '?' or '#': percent-encode it "
            "(urllib.parse.quote(password, safe=''))"
        )
    return url


def tls_options(url: str) -> dict[str, Any]:
    """Options a ``rediss://`` URL gets unless its query says otherwise: the server's
    certificate must name the URL's host (redis-py 5 checks only that a trusted CA signed it,
    and any certificate of that CA, a public one for any name, would pass)."""
    query = dict(parse_qsl(urlsplit(url).query))
    if not url.startswith("rediss://") or query.get("ssl_cert_reqs", "").lower() == "none":
        return {}
    return {"ssl_check_hostname": True}


_FALSE = ("", "0", "F", "FALSE", "N", "NO")
"""What redis-py reads as false in a URL's boolean option."""


def arq_redis_settings(url: str) -> Any:
    """arq's ``RedisSettings`` for ``url``, with the TLS options of its query that arq's
    ``from_dsn`` drops (CA file, client certificate and key, verification) and the host name
    check of :func:`tls_options`."""
    from arq.connections import RedisSettings

    settings = RedisSettings.from_dsn(check_url(url))
    for name, value in {**tls_options(url), **dict(parse_qsl(urlsplit(url).query))}.items():
        if name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
            setattr(settings, name, value)
        elif name == "ssl_check_hostname":
            # as redis-py reads it from a URL: anything but these is true
            settings.ssl_check_hostname = str(value).upper() not in _FALSE
    return settings


@contextmanager
def reaching(url: str) -> Iterator[None]:
    """Redis refusing or dropping the connection (or the credentials) inside raises
    ``PoolUnreachable``, naming the URL (password masked) and where it came from; lmpool's own
    errors pass as they are."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as e:  # redis-py wraps socket errors
        raise PoolUnreachable(
            f"cannot reach the pool's Redis at {masked_url(url)} (LMPOOL_REDIS_URL, unless a URL "
            f"was passed): {e}"
        ) from e


def probe(url: str, timeout_s: float = 5.0, *, blocking: bool = False) -> Any:
    """A plain client of the one node ``url`` names, for a question or two (none of the pools'
    options): the URL checked (``ValueError``), its TLS options, short timeouts; ``blocking``:
    redis-py's synchronous client."""
    client: Any = sync_redis.Redis if blocking else Redis
    t = timeout_s
    options = {"socket_connect_timeout": t, "socket_timeout": t, **tls_options(url)}
    return client.from_url(check_url(url), **options)


def is_cluster(url: str) -> bool:
    """Whether ``url`` names a node of a Redis Cluster (asked once, then remembered)."""
    if url not in _CLUSTER:
        node = probe(url, blocking=True)
        try:
            info: Any = node.info("cluster")
            _CLUSTER[url] = bool(int(info.get("cluster_enabled", 0)))
        finally:
            node.close()
    return _CLUSTER[url]


async def is_cluster_async(url: str) -> bool:
    """:func:`is_cluster` without blocking the event loop on the first ask."""
    if url not in _CLUSTER:
        node = probe(url)
        try:
            info: Any = await node.info("cluster")
            _CLUSTER[url] = bool(int(info.get("cluster_enabled", 0)))
        finally:
            await node.aclose()
    return _CLUSTER[url]


CLUSTER_RETRY_ATTEMPTS = 30
"""Cluster client: attempts of a command whose node fails (each re-reads the slot map)."""
_CLUSTER_RETRY_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def _cluster_options(asynchronous: bool) -> dict[str, Any]:
    """Settings that ride over a failover (measured in ``tests/test_redis_cluster.py``): a
    refused connect is an ``OSError``, which redis-py's default retry does not retry, and its
    cluster-level attempts do not pause; with these, each attempt backs off ~0.34 s and 30 of
    them cover ~10 s, more than a failover takes (~2.4 s at a 1 s node timeout)."""
    from redis.retry import Retry as SyncRetry

    kind = Retry if asynchronous else SyncRetry
    retry = kind(
        ExponentialBackoff(cap=0.1, base=0.01),
        5,
        supported_errors=_CLUSTER_RETRY_ERRORS,  # type: ignore[arg-type]
    )
    return {"cluster_error_retry_attempts": CLUSTER_RETRY_ATTEMPTS, "retry": retry}


def moving_slot(answer: Any) -> Any:
    """A script refused because a key it names inside (a digest's) is in a slot moving to
    another node ("non local key": no redirection can follow it), as the transient state it
    is: ``TryAgainError``, which callers retry after a pause; any other answer as it is."""
    if not isinstance(answer, ResponseError) or "non local key" not in str(answer):
        return answer
    again = TryAgainError()  # type: ignore[no-untyped-call]
    again.args = ("a slot is moving between cluster nodes: Redis refused a script's key",)
    return again


async def load_script(redis: Any, source: str) -> None:
    """``SCRIPT LOAD``; on a cluster on every node the client knows, replicas too, each as it
    can (Redis 7 does not replicate SCRIPT LOAD, and right after a failover redis-py may still
    count the promoted replica among the replicas: a load on the primaries alone missed it, and
    the EVALSHA after it met NOSCRIPT again, ``tests/test_cluster_pool.py``)."""
    if not isinstance(redis, RedisCluster):
        await redis.script_load(source)
        return
    for node in redis.get_nodes():
        with contextlib.suppress(RedisError):  # a node down: not one the call goes to
            await node.execute_command("SCRIPT", "LOAD", source)


def load_script_sync(redis: Any, source: str) -> None:
    """:func:`load_script` for the blocking clients."""
    if not isinstance(redis, sync_redis.RedisCluster):
        redis.script_load(source)
        return
    for node in redis.get_nodes():
        if node.redis_connection is not None:
            with contextlib.suppress(RedisError):
                node.redis_connection.script_load(source)


class _Pipeline(ClusterPipeline):
    """redis-py's cluster pipeline, whose ``execute`` reads its client's default node after
    running the commands: None while another task's command has the client re-read the
    topology (a failover, a slot moving), which raised ``AttributeError`` and ended the
    worker's reader. Raised there, once every command has its answer (the default node only
    decides whether to replace it), the answers are returned: thrown away, they lost what
    the commands had done (the waiter sets a FINISH took, the entries an XREADGROUP
    delivered). Anywhere else it is said as the transient state it is: ``ClusterDownError``."""

    async def _execute(self, client: Any, stack: Any, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return await super()._execute(client, stack, *args, **kwargs)
        except AttributeError as e:
            tb = e.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            if (
                tb is None
                or tb.tb_frame.f_code is not ClusterPipeline._execute.__code__
                or client.get_default_node() is not None
            ):
                raise
            return [cmd.result for cmd in stack]

    async def execute(self, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return await super().execute(*args, **kwargs)
        except AttributeError as e:
            if self._client.get_default_node() is not None:
                raise
            raise ClusterDownError(  # type: ignore[no-untyped-call]
                f"the cluster client is re-reading its topology ({e})"
            ) from e


class _Cluster(RedisCluster):
    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        super().pipeline(transaction, shard_hint)  # its checks of the arguments
        return _Pipeline(self)  # type: ignore[abstract]  # as redis-py makes its own


class DirectSend:
    """A connection mixin: a command goes onto the socket without a task of its own.

    With a socket timeout set, redis-py 5 sends every command through ``asyncio.wait_for``,
    which on Python 3.11 runs the send in a new task and wakes the caller through a second
    future: two event-loop iterations and three callbacks per command, for a write that almost
    never waits (a transport buffers what the socket does not take at once). Here the command is
    handed to the transport directly; only when the transport's buffer is above its high-water
    mark (the server reads slower than we write) is the drain awaited, under the timeout as
    before. Errors end the same way as in redis-py: the connection dropped, a
    ``ConnectionError`` or ``TimeoutError`` raised.
    """

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        conn: Any = self
        writer: asyncio.StreamWriter | None = conn._writer
        if not conn.is_connected or writer is None or not conn.socket_timeout:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        if check_health:
            await conn.check_health()  # a PING only when health_check_interval has passed
        try:
            if isinstance(command, str):
                command = command.encode()
            writer.writelines([command] if isinstance(command, bytes) else command)
            transport = writer.transport
            if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
                await asyncio.wait_for(writer.drain(), conn.socket_timeout)
            else:
                await writer.drain()  # returns at once (raises if the connection was lost)
        except asyncio.TimeoutError:
            await conn.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as e:
            await conn.disconnect(nowait=True)
            raise RedisConnectionError(f"Error while writing to socket: {e!r}.") from e
        except BaseException:
            await conn.disconnect(nowait=True)
            raise


_DIRECT: dict[type, type] = {}


def direct_send(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """``connection_class`` (plain, TLS or unix socket) with :class:`DirectSend` mixed in."""
    if connection_class not in _DIRECT:
        name = f"DirectSend{connection_class.__name__}"
        _DIRECT[connection_class] = type(name, (DirectSend, connection_class), {})
    return _DIRECT[connection_class]


class ReadyPool(ConnectionPool):
    """redis-py's connection pool without its zero-timeout read before every command.

    Before handing out a connection, redis-py 5 makes sure nothing is left to read on it by
    reading under ``asyncio.timeout(0)``: a timer, an event-loop iteration and a cancelled read
    per command, two or three per request on each side of the pool (``bench/overhead.py``: the
    producer's and the worker's CPU per request at one in flight 10-20% lower without it).
    redis-py drops a connection whose command failed or was cancelled before its reply was
    read, so a pooled connection holds nothing unless the server sent something unasked, and
    what arrived is in the connection's buffers (the stream's and the reply parser's), looked at
    here without a read; the full check runs when either holds anything or the server closed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection_class = direct_send(self.connection_class)

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        await connection.connect()  # type: ignore[no-untyped-call]  # a no-op when connected
        parser: Any = getattr(getattr(connection, "_parser", None), "_reader", None)
        stream: Any = getattr(connection, "_reader", None)  # its asyncio.StreamReader
        if (
            stream is not None
            and not stream.at_eof()
            and not stream._buffer
            and callable(getattr(parser, "has_data", None))
            and not parser.has_data()
        ):
            return
        await super().ensure_connection(connection)


def _socket_options(url: str) -> dict[str, Any]:
    """Connection options both clients share; TCP keepalive where the URL is TCP (redis-py's
    unix socket connection refuses the option)."""
    options: dict[str, Any] = {"health_check_interval": 30, "socket_connect_timeout": 5}
    options.update(tls_options(url))
    if not url.startswith("unix://"):
        options["socket_keepalive"] = True
    return options


def connect_redis(url: str, **kwargs: Any) -> AnyRedis:
    """A client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs, binary replies; a
    cluster client when the URL names a cluster node (see :func:`is_cluster`, which must have
    been asked for this URL: it is remembered, and asked here if not)."""
    cluster = _CLUSTER.get(url)
    if cluster is None:
        cluster = is_cluster(url)
    options: dict[str, Any] = {
        **_socket_options(url),
        # No command of lmpool blocks for more than a few seconds: a read that takes longer is a
        # dead connection (a server restarted under us), to be dropped and retried.
        "socket_timeout": 15,
        # results are vocabulary rows (200 KB-1 MB): reading them in 1 MiB chunks instead of
        # 64 KiB costs redis-py's asyncio reader ~30% less CPU per row (measured on 196 KB)
        "socket_read_size": 1 << 20,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=4),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    options.update(kwargs)
    if cluster:
        for unsupported in ("health_check_interval", "socket_read_size"):
            options.pop(unsupported, None)
        options.update(_cluster_options(asynchronous=True))
        # redis-py's from_url are Any to mypy (Redis.from_url has no return annotation)
        return cast(RedisCluster, _Cluster.from_url(url, decode_responses=False, **options))
    return Redis.from_pool(ReadyPool.from_url(url, decode_responses=False, **options))


def connect_redis_sync(url: str, **kwargs: Any) -> Any:
    """The blocking client of :func:`connect_redis` (same options), for callers without a loop."""
    from redis.retry import Retry as SyncRetry

    options: dict[str, Any] = {
        **_socket_options(url),
        "socket_timeout": 15,
        "retry": SyncRetry(ExponentialBackoff(cap=1.0, base=0.05), retries=4),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    options.update(kwargs)
    if is_cluster(url):
        options.pop("health_check_interval", None)
        options.update(_cluster_options(asynchronous=False))
        return sync_redis.RedisCluster.from_url(url, decode_responses=False, **options)
    return sync_redis.Redis.from_url(url, decode_responses=False, **options)


class Backoff:
    """Growing pauses between attempts while Redis is unreachable."""

    def __init__(self, first_s: float = 0.05, cap_s: float = 2.0) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self.next_s = first_s

    def reset(self) -> None:
        self.next_s = self.first_s

    def step(self) -> float:
        wait, self.next_s = self.next_s, min(self.next_s * 2, self.cap_s)
        return wait
