"""Prometheus metrics of one worker, served on ``LMPOOL_METRICS_PORT`` (0: off).

Each worker owns a registry (not prometheus_client's global one), so several workers can live
in one process (tests) without clashing names.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shared.errors import SettingsError

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, model: str, backend: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model, "backend": backend}
        self.batch_size = Histogram(
            "lmpool_batch_size", "Requests finished per backend step", list(labels),
            buckets=BATCH_BUCKETS, registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.batch_seconds = Histogram(
            "lmpool_batch_seconds", "Time of one backend step",
            list(labels), buckets=SECONDS_BUCKETS, registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.queue_wait = Histogram(
            "lmpool_queue_wait_seconds", "From a request's arrival in its stream to its answer",
            list(labels), buckets=SECONDS_BUCKETS, registry=self.registry,
        ).labels(**labels)  # fmt: skip
        outcomes = Counter(
            "lmpool_requests", "Requests answered, by outcome",
            [*labels, "outcome"], registry=self.registry,
        )  # fmt: skip
        self.outcome = {
            name: outcomes.labels(**labels, outcome=name)
            for name in (
                "computed",
                "cache_hit",
                "skipped",
                "error",
                "expired",
                "dead_letter",
                "duplicate",
            )
        }
        self.kv_bytes = Gauge(
            "lmpool_kv_cache_bytes", "Bytes of cached key/value tensors", list(labels),
            registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.kv_arena_bytes = Gauge(
            "lmpool_kv_arena_bytes", "Memory the KV cache's arena holds (cached or free slots)",
            list(labels), registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.kv_hit_rate = Gauge(
            "lmpool_kv_hit_rate", "Prompt tokens reused from the KV cache / tokens requested",
            list(labels), registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.tenant_counters = {
            name: Counter(
                f"lmpool_tenant_{name}", what, [*labels, "tenant"], registry=self.registry
            )
            for name, what in (
                ("requests", "Requests answered, by tenant ('-': none)"),
                ("computed", "Distinct requests computed, by tenant"),
                ("prompt_tokens", "Prompt tokens of the requests computed, by tenant"),
                ("cache_hits", "Requests answered from the shared cache by the worker, by tenant"),
                ("wait_seconds", "Seconds requests waited in their streams, by tenant"),
                ("compute_seconds", "Seconds of backend steps (shared equally by rows), by tenant"),
            )
        }
        self._labels = labels
        self._tenants_seen: dict[tuple[str, str], float] = {}
        self._server: Any = None

    def serve(self, port: int) -> None:
        """Expose ``/metrics`` on ``port`` (all interfaces); a port taken is a setting error."""
        try:
            self._server, _ = start_http_server(port, registry=self.registry)
        except OSError as e:
            raise SettingsError(
                f"LMPOOL_METRICS_PORT={port}: cannot serve metrics there: {e}"
            ) from None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def observe_step(self, rows: int, seconds: float) -> None:
        """One backend step: how many works it finished and how long it took."""
        self.batch_size.observe(rows)
        self.batch_seconds.observe(seconds)

    def observe_written(self, entry_ids: list[str], outcomes: list[str], now_ms: float) -> None:
        """Entries answered in one write, and the outcome of each distinct request; ``now_ms``
        on the Redis server's clock, as the entry ids are (not this host's)."""
        for entry_id in entry_ids:
            # A stream entry id starts with the Redis server's clock (ms) at XADD time.
            added_ms = int(entry_id.split("-", 1)[0])
            self.queue_wait.observe(max(now_ms - added_ms, 0) / 1000)
        counts: dict[str, int] = {}
        for name in outcomes:
            counts[name] = counts.get(name, 0) + 1
        counts["duplicate"] = max(len(entry_ids) - len(outcomes), 0)
        for name, n in counts.items():
            if n and name in self.outcome:
                self.outcome[name].inc(n)

    def observe_tenants(self, tenants: dict[str, dict[str, float]]) -> None:
        """Bring the per-tenant counters up to the worker's totals (``Stats.tenants``)."""
        for tenant, counters in tenants.items():
            for name, counter in self.tenant_counters.items():
                value = counters.get(name.replace("_seconds", "_s"), 0.0)  # Stats' names
                before = self._tenants_seen.get((tenant, name), 0.0)
                if value > before:
                    counter.labels(**self._labels, tenant=tenant).inc(value - before)
                    self._tenants_seen[(tenant, name)] = value

    def observe_kv(self, stats: dict[str, int]) -> None:
        self.kv_bytes.set(stats.get("bytes_used", 0))
        self.kv_arena_bytes.set(stats.get("arena_bytes", 0))
        requested = stats.get("tokens_requested", 0)
        self.kv_hit_rate.set(stats.get("tokens_reused", 0) / requested if requested else 0.0)
