"""A private Redis Cluster for the tests and the benchmarks: ``RedisCluster`` starts N masters
with R replicas each on loopback, forms the cluster, and kills, fails over, restarts and heals
its nodes on demand. No Redis installation needed: it runs the binary ``RedisServer`` runs.

Its nodes (``ClusterMember``, ports, ``CLUSTER NODES`` parsing, readiness checks) are in
``localpool.redis_cluster_nodes``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis

from localpool.redis_cluster_nodes import (
    CLUSTER_BUS_OFFSET,
    CLUSTER_SLOTS,
    ClusterMember,
    NodeView,
    consensus,
    describe,
    free_cluster_port,
    parse_cluster_nodes,
    ready_views,
    server_args,
)
from localpool.redis_server import find_server_binary
from shared import heap

__all__ = ["CLUSTER_BUS_OFFSET", "CLUSTER_SLOTS", "ClusterMember", "RedisCluster"]


class RedisCluster:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each, on loopback.

    Every node is a ``redis-server`` process (the binary :func:`find_server_binary` picks) in
    its own directory under one private temporary directory, on a port from
    :func:`free_cluster_port`. Slots are split evenly over the masters in node order; node
    ``masters + i * replicas + j`` is replica ``j`` of master ``i``. The cluster is formed with
    ``CLUSTER ADDSLOTSRANGE`` / ``MEET`` / ``REPLICATE`` (no ``redis-cli`` needed), and
    :meth:`start` returns once every node reports ``cluster_state:ok``, all nodes agree on who
    serves what, and every replica is in sync (``master_link_status:up``).

    ``node_timeout_ms`` is ``cluster-node-timeout``: the failure detection time, which bounds
    how fast a failover can be. ``cluster-replica-validity-factor 0`` lets any replica take
    over however long it was cut off. ``appendonly`` gives each node an AOF (``appendfsync
    always``, as :class:`RedisServer`).

    Usage::

        with RedisCluster() as cluster:                 # 3 masters x 1 replica
            r = redis.cluster.RedisCluster.from_url(cluster.url)
            r.set("k", "v")
            old = cluster.master_of("k")
            cluster.kill(old)                           # SIGKILL
            new = cluster.wait_failover(old)            # its replica, promoted
            cluster.restart(old)                        # back, as a replica of ``new``
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        *,
        appendonly: bool = False,
        node_timeout_ms: int = 1000,
        binary: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError("a cluster needs masters >= 1 and replicas >= 0")
        self.binary = binary or find_server_binary()
        self.n_masters = masters
        self.n_replicas = replicas
        self.appendonly = appendonly
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = list(extra_args or [])
        self.dir = Path(tempfile.mkdtemp(prefix="lmpool-cluster-"))
        taken: set[int] = set()
        self.nodes: list[ClusterMember] = []
        for i in range(masters * (1 + replicas)):
            node_dir = self.dir / f"node-{i}"
            node_dir.mkdir()
            self.nodes.append(ClusterMember(index=i, port=free_cluster_port(taken), dir=node_dir))
        self.startup_s: float | None = None
        """Seconds :meth:`start` took, from the first process started to a ready cluster."""

    # -- addresses ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` of the first live master (node order): any node's URL
        gives a cluster client the whole topology."""
        for node in self.nodes:
            if node.alive and node.role == "master":
                return node.url
        for node in self.nodes:
            if node.alive:
                return node.url
        raise RuntimeError("no live node in the cluster")

    @property
    def masters(self) -> list[ClusterMember]:
        """Live masters, as last read (see :meth:`refresh`)."""
        return [n for n in self.nodes if n.alive and n.role == "master"]

    @property
    def replicas(self) -> list[ClusterMember]:
        """Live replicas, as last read (see :meth:`refresh`)."""
        return [n for n in self.nodes if n.alive and n.role == "replica"]

    def node(self, which: ClusterMember | int | str) -> ClusterMember:
        """The member given itself, by port, or by node id."""
        if isinstance(which, ClusterMember):
            return which
        for n in self.nodes:
            if n.port == which or (isinstance(which, str) and n.node_id == which):
                return n
        raise KeyError(f"no cluster node {which!r}")

    def replicas_of(self, master: ClusterMember | int | str) -> list[ClusterMember]:
        master_id = self.node(master).node_id
        return [n for n in self.nodes if n.role == "replica" and n.master_id == master_id]

    def master_of(self, key: str | bytes) -> ClusterMember:
        """The node serving ``key``'s slot now (``CLUSTER KEYSLOT`` + ``CLUSTER NODES``)."""
        node = self._any_live()
        admin = node.admin()
        slot = int(admin.execute_command("CLUSTER", "KEYSLOT", key))
        views = parse_cluster_nodes(admin.execute_command("CLUSTER", "NODES"))
        for view in views.values():
            if view.role == "master" and any(lo <= slot <= hi for lo, hi in view.slots):
                return self.node(view.node_id)
        raise RuntimeError(f"slot {slot} of {key!r} is served by no master")

    # -- life cycle --------------------------------------------------------------------------

    def _args(self, node: ClusterMember) -> list[str]:
        return server_args(
            self.binary,
            node,
            node_timeout_ms=self.node_timeout_ms,
            appendonly=self.appendonly,
            extra_args=self.extra_args,
        )

    def _spawn(self, node: ClusterMember) -> None:
        node.close_admin()
        node.proc = subprocess.Popen(
            self._args(node),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=heap.server_environment(),
        )

    def _wait_answers(self, nodes: list[ClusterMember], deadline: float) -> None:
        pending = list(nodes)
        while pending:
            for node in list(pending):
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.binary} on port {node.port} exited at start: {node.log()}"
                    )
                try:
                    if node.admin().ping():
                        pending.remove(node)
                except redis.RedisError:
                    pass
            if pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nodes on ports {[n.port for n in pending]} never answered")
                time.sleep(0.01)

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        """Start every node, form the cluster, and wait until it is ready (see class doc)."""
        if any(n.node_id or n.alive for n in self.nodes):
            raise RuntimeError("cluster already started: restart(node) or heal() bring nodes back")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        try:
            for node in self.nodes:
                self._spawn(node)
            self._wait_answers(self.nodes, deadline)
            for node in self.nodes:
                node.node_id = node.admin().execute_command("CLUSTER", "MYID")
            per_master = CLUSTER_SLOTS // self.n_masters
            for i, master in enumerate(self.nodes[: self.n_masters]):
                lo = i * per_master
                hi = CLUSTER_SLOTS - 1 if i == self.n_masters - 1 else lo + per_master - 1
                admin = master.admin()
                # distinct config epochs up front, as redis-cli does: no epoch collisions to
                # resolve before the cluster settles
                admin.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                admin.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            first = self.nodes[0].admin()
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait(
                lambda: all(self._knows_everyone(n) for n in self.nodes),
                deadline,
                "every node to know every other",
            )
            for i in range(self.n_masters):
                master = self.nodes[i]
                for j in range(self.n_replicas):
                    replica = self.nodes[self.n_masters + i * self.n_replicas + j]
                    replica.admin().execute_command("CLUSTER", "REPLICATE", master.node_id)
                    replica.role, replica.master_id = "replica", master.node_id
            self._wait(
                lambda: all(
                    n.info("replication").get("master_link_status") == "up"
                    for n in self.nodes[self.n_masters :]
                ),
                deadline,
                "the replicas to sync",
            )
            for master in self.nodes[: self.n_masters]:
                # a first replicated write: a replica whose offset is still 0 is left out of
                # CLUSTER SLOTS, so clients would not see it
                master.admin().flushall()
            self.wait_ready(timeout_s=max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _knows_everyone(self, node: ClusterMember) -> bool:
        views = parse_cluster_nodes(node.admin().execute_command("CLUSTER", "NODES"))
        return len(views) == len(self.nodes) and not any(
            "handshake" in v.flags or "noaddr" in v.flags for v in views.values()
        )

    def kill(self, node: ClusterMember | int | str) -> ClusterMember:
        """SIGKILL one node (a crash: nothing flushed beyond what the AOF already holds)."""
        member = self.node(node)
        member.close_admin()
        if member.proc is not None:
            member.proc.kill()
            member.proc.wait()
            member.proc = None
        return member

    def wait_failover(
        self, dead_node: ClusterMember | int | str, timeout_s: float = 10.0
    ) -> ClusterMember:
        """Wait until a replica of the killed master ``dead_node`` was promoted, every live
        node agrees, and ``cluster_state:ok`` holds everywhere again. Returns the new master.
        """
        dead = self.node(dead_node)
        if dead.alive:
            raise ValueError(f"node {dead.port} is alive: kill it first")
        if dead.role != "master":
            raise ValueError(f"node {dead.port} was a replica: there is nothing to fail over")
        heirs = {n.node_id for n in self.replicas_of(dead) if n.alive}
        if not heirs:
            raise ValueError(f"master {dead.port} has no live replica to promote")
        deadline = time.monotonic() + timeout_s

        def promoted() -> bool:
            views = self._consensus()
            return views is not None and any(
                views[h].role == "master" and views[h].slots for h in heirs
            )

        self._wait(promoted, deadline, f"a replica of {dead.port} to take over")
        self.wait_ready(timeout_s=max(0.1, deadline - time.monotonic()))
        return next(n for n in self.nodes if n.node_id in heirs and n.role == "master")

    def restart(self, node: ClusterMember | int | str, timeout_s: float = 20.0) -> ClusterMember:
        """Start a killed (or stopped) node again from its directory (``nodes.conf``, AOF).
        A former master whose slots went to its replica comes back as that node's replica.
        Returns once it is in sync and the cluster is ready again."""
        member = self.node(node)
        if member.alive:
            raise ValueError(f"node {member.port} is running")
        deadline = time.monotonic() + timeout_s
        self._spawn(member)
        self._wait_answers([member], deadline)
        self.wait_ready(timeout_s=max(0.1, deadline - time.monotonic()))
        return member

    def heal(self, timeout_s: float = 30.0) -> None:
        """Restart every node that is not running, then wait until the cluster is ready."""
        deadline = time.monotonic() + timeout_s
        dead = [n for n in self.nodes if not n.alive]
        for member in dead:
            self._spawn(member)
        self._wait_answers(dead, deadline)
        self.wait_ready(timeout_s=max(0.1, deadline - time.monotonic()))

    def flushall(self) -> None:
        """``FLUSHALL`` on every live master, then ``WAIT`` until its replicas applied it."""
        self.refresh()
        for master in self.masters:
            admin = master.admin()
            admin.flushall()
            live = [r for r in self.replicas_of(master) if r.alive]
            if live:
                admin.execute_command("WAIT", len(live), 1000)

    def stop(self) -> None:
        """Terminate every node (SIGTERM, SIGKILL after 10 s). The directory stays:
        :meth:`heal` starts the same cluster again (``nodes.conf``, and the data with
        ``appendonly``)."""
        for node in self.nodes:
            node.close_admin()
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
            node.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()

    # -- state -------------------------------------------------------------------------------

    def refresh(self) -> list[ClusterMember]:
        """Read roles and masters from the live nodes' shared view (when they agree)."""
        views = self._consensus()
        if views is not None:
            self._apply(views)
        return self.nodes

    def _any_live(self) -> ClusterMember:
        for node in self.nodes:
            if node.alive:
                return node
        raise RuntimeError("no live node in the cluster")

    def _consensus(self) -> dict[str, NodeView] | None:
        return consensus(self.nodes)

    def _apply(self, views: dict[str, NodeView]) -> None:
        for node in self.nodes:
            view = views.get(node.node_id)
            if view is not None and node.alive:
                node.role, node.master_id = view.role, view.master_id

    def ready(self) -> bool:
        """Every live node: ``cluster_state:ok``, all slots served, the same view of the
        cluster; every live replica: ``master_link_status:up`` (see
        :func:`~localpool.redis_cluster_nodes.ready_views`)."""
        views = ready_views(self.nodes)
        if views is None:
            return False
        self._apply(views)
        return True

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        self._wait(self.ready, time.monotonic() + timeout_s, "the cluster to be ready")

    def _wait(self, predicate: Callable[[], bool], deadline: float, what: str) -> None:
        while True:
            try:
                if predicate():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n{self.describe()}")
            time.sleep(0.02)

    def describe(self) -> str:
        """Each node's own view, for error messages."""
        return describe(self.nodes)
