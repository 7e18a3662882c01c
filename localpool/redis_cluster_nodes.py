"""The nodes of a :class:`~localpool.redis_cluster.RedisCluster`: ports, processes, and what they
say about the cluster.

``ClusterMember`` is one ``redis-server`` process; the functions read ``CLUSTER NODES`` /
``CLUSTER INFO`` / ``CLUSTER SLOTS`` of live members and tell whether they agree
(:func:`consensus`) and whether the cluster is ready for clients (:func:`ready_views`).
"""

from __future__ import annotations

import random
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from localpool.redis_server import free_port

CLUSTER_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000
"""The cluster bus listens on port + 10,000: a node's port must leave that below 65,536."""


def free_cluster_port(taken: set[int] | None = None) -> int:
    """A loopback port ``p`` free together with its cluster bus port ``p + 10000``.

    Picked below the kernel's ephemeral range when it leaves room (``p + 10000`` under its
    start: outgoing connections never take such ports), else from the ephemeral range; always
    ``p < 55535``. ``taken`` holds ports (and bus ports) already promised: it is updated.
    """
    taken = taken if taken is not None else set()
    ephemeral_low = 32768
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    high = min(ephemeral_low, 65536 - CLUSTER_BUS_OFFSET) - CLUSTER_BUS_OFFSET
    rng = random.Random()
    for attempt in range(2000):
        port = rng.randrange(11000, high) if high > 11000 and attempt < 1000 else free_port()
        bus = port + CLUSTER_BUS_OFFSET
        if port >= 65535 - CLUSTER_BUS_OFFSET or port in taken or bus in taken:
            continue
        if _bindable(port) and _bindable(bus):
            taken.update((port, bus))
            return port
    raise RuntimeError("no free port pair (port, port + 10000) on 127.0.0.1")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(eq=False)
class ClusterMember:
    """One ``redis-server`` process of a :class:`~localpool.redis_cluster.RedisCluster`.

    ``role`` (``"master"`` or ``"replica"``) and ``master_id`` are the cluster's view as last
    read by the launcher (after start, a failover, a restart, or ``RedisCluster.refresh()``).
    """

    index: int
    port: int
    dir: Path
    node_id: str = ""
    role: str = "master"
    master_id: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _admin: redis.Redis | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive and self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def admin(self) -> redis.Redis:
        """A plain (non-cluster) client of this node, short timeouts, replies decoded."""
        if self._admin is None:
            self._admin = redis.Redis(
                host="127.0.0.1",
                port=self.port,
                socket_timeout=2.0,
                socket_connect_timeout=1.0,
                decode_responses=True,
            )
        return self._admin

    def info(self, section: str = "replication") -> dict[str, Any]:
        """``INFO section`` of this node, parsed."""
        return cast("dict[str, Any]", self.admin().info(section))

    def dbsize(self) -> int:
        return int(cast(Any, self.admin().dbsize()))

    def close_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def log(self) -> str:
        """The end of this node's server log (for error messages)."""
        path = self.dir / "server.log"
        return path.read_text()[-2000:] if path.exists() else ""


@dataclass
class NodeView:
    """One line of ``CLUSTER NODES``."""

    node_id: str
    port: int
    flags: set[str]
    master_id: str
    slots: list[tuple[int, int]]

    @property
    def role(self) -> str:
        return "replica" if "slave" in self.flags else "master"

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})


def cluster_info(client: redis.Redis) -> dict[str, str]:
    text = client.execute_command("CLUSTER", "INFO")
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def replicas_listed(client: redis.Redis, expected: dict[int, set[int]]) -> bool:
    """Whether ``CLUSTER SLOTS`` lists each master's expected replicas (clients read the
    topology from it)."""
    listed: dict[int, set[int]] = {}
    for entry in client.execute_command("CLUSTER", "SLOTS"):
        listed.setdefault(int(entry[2][1]), set()).update(int(r[1]) for r in entry[3:])
    return all(ports <= listed.get(master, set()) for master, ports in expected.items())


def parse_cluster_nodes(text: str) -> dict[str, NodeView]:
    views: dict[str, NodeView] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        address = parts[1].split("@")[0].split(",")[0]
        slots: list[tuple[int, int]] = []
        for item in parts[8:]:
            if item.startswith("["):  # a slot being imported or migrated
                continue
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        views[parts[0]] = NodeView(
            node_id=parts[0],
            port=int(address.rsplit(":", 1)[1]),
            flags=set(parts[2].split(",")),
            master_id="" if parts[3] == "-" else parts[3],
            slots=slots,
        )
    return views


def server_args(
    binary: str,
    node: ClusterMember,
    *,
    node_timeout_ms: int,
    appendonly: bool,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line of ``node``'s server: cluster mode, and what makes failovers and
    replica syncs quick on loopback."""
    return [
        binary,
        "--port", str(node.port),
        "--bind", "127.0.0.1",
        "--dir", str(node.dir),
        "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(node_timeout_ms),
        "--cluster-replica-validity-factor", "0",
        "--cluster-allow-replica-migration", "no",
        "--repl-diskless-sync", "yes",
        "--repl-diskless-sync-delay", "0",
        # a master's PINGs move its replicas' offsets: a replica at offset 0 (a master
        # restarted without writes since) is left out of CLUSTER SLOTS
        "--repl-ping-replica-period", "1",
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        "--appendfsync", "always",
        "--logfile", str(node.dir / "server.log"),
        "--daemonize", "no",
        *extra_args,
    ]  # fmt: skip


def consensus(nodes: Sequence[ClusterMember]) -> dict[str, NodeView] | None:
    """The view every live node shares of the live nodes (roles, masters, slots), or
    None while they disagree, a live node is flagged failing, or a node cannot answer."""
    live = [n for n in nodes if n.alive]
    live_ids = {n.node_id for n in live}
    shared: dict[str, tuple[str, str, tuple[tuple[int, int], ...]]] | None = None
    first: dict[str, NodeView] | None = None
    try:
        for node in live:
            views = parse_cluster_nodes(node.admin().execute_command("CLUSTER", "NODES"))
            if not live_ids <= set(views):
                return None
            mine = {}
            for node_id in live_ids:
                v = views[node_id]
                if v.failing:
                    return None
                mine[node_id] = (v.role, v.master_id, tuple(v.slots))
            if shared is None:
                shared, first = mine, views
            elif mine != shared:
                return None
    except redis.RedisError:
        return None
    return first


def ready_views(nodes: Sequence[ClusterMember]) -> dict[str, NodeView] | None:
    """The shared view (:func:`consensus`) once the cluster is ready, else None. Ready: every
    live node has ``cluster_state:ok``, all slots served and the same view of the cluster;
    every live replica has ``master_link_status:up`` to the master that view names, and
    every node's ``CLUSTER SLOTS`` lists every live replica (clients read the topology there).
    """
    try:
        for node in nodes:
            if not node.alive:
                continue
            info = cluster_info(node.admin())
            if info.get("cluster_state") != "ok":
                return None
            if int(info.get("cluster_slots_ok", 0)) != CLUSTER_SLOTS:
                return None
        views = consensus(nodes)
        if views is None:
            return None
        for node in nodes:
            view = views.get(node.node_id)
            if not node.alive or view is None or view.role != "replica":
                continue
            repl = node.info("replication")
            if repl.get("master_link_status") != "up" or repl.get("master_sync_in_progress"):
                return None
            master = views.get(view.master_id)
            if master is None or master.port != int(repl.get("master_port", -1)):
                return None
        expected: dict[int, set[int]] = {}
        for node in nodes:
            view = views.get(node.node_id)
            if node.alive and view is not None and view.role == "replica":
                expected.setdefault(views[view.master_id].port, set()).add(node.port)
        for node in nodes:
            if node.alive and not replicas_listed(node.admin(), expected):
                return None
        return views
    except redis.RedisError:
        return None


def describe(nodes: Sequence[ClusterMember]) -> str:
    """Each node's own view, for error messages."""
    lines = []
    for node in nodes:
        if not node.alive:
            lines.append(f"node {node.index} :{node.port} DOWN")
            continue
        try:
            admin = node.admin()
            state = cluster_info(admin).get("cluster_state")
            text = admin.execute_command("CLUSTER", "NODES")
        except redis.RedisError as e:
            lines.append(f"node {node.index} :{node.port} error {e}")
            continue
        lines.append(f"node {node.index} :{node.port} state={state}\n{text}")
    return "\n".join(lines)
