"""docker-compose.yml against the settings module (no Docker engine runs here)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def cluster_nodes(services: dict) -> list[str]:
    return [
        name
        for name, service in services.items()
        if "--cluster-enabled yes" in str(service.get("command", ""))
    ]


def test_services_and_their_commands() -> None:
    services = load()["services"]
    assert {"redis", "worker-gpu", "worker-cpu", "producer"} <= set(services)
    for name in ("worker-gpu", "worker-cpu"):
        assert services[name]["command"] == ["arq", "worker.WorkerSettings"]
    assert services["producer"]["command"][:3] == ["python", "-m", "localpool.demo"]
    assert (ROOT / "localpool" / "demo.py").exists()


def test_every_lmpool_variable_is_a_valid_setting() -> None:
    for name, service in load()["services"].items():
        env = {
            k: ("" if "${" in str(v) else str(v))
            for k, v in (service.get("environment") or {}).items()
        }
        settings = Settings.from_env(env)  # unknown or invalid LMPOOL_ variables raise
        if name.startswith("worker") and "cluster" in service.get("profiles", []):
            assert urlsplit(settings.redis_url).hostname in cluster_nodes(load()["services"])
            assert settings.arq_redis_url == "redis://redis:6379/0"
            assert settings.metrics_port > 0
        elif name.startswith("worker"):
            assert settings.redis_url == "redis://redis:6379/0"
            assert settings.metrics_port > 0


def test_gpu_reservation_and_redis_persistence() -> None:
    services = load()["services"]
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "deploy" not in services["worker-cpu"]
    command = services["redis"]["command"]
    assert "--appendonly yes" in command
    assert "--maxmemory-policy volatile-lru" in command


def test_cluster_profile() -> None:
    """`docker compose --profile cluster up`: 3 masters x 1 replica, formed by a one-shot
    service, and a CPU worker on the cluster with arq's queue on the plain `redis`."""
    compose = load()
    services = compose["services"]
    nodes = cluster_nodes(services)
    assert len(nodes) == 6
    for name in nodes:
        node = services[name]
        assert node["profiles"] == ["cluster"] and node["image"].startswith("redis:7")
        assert "--cluster-replica-validity-factor 0" in node["command"]
        assert "--appendonly yes" in node["command"]
        assert node["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
        ((volume, mount),) = (v.split(":") for v in node["volumes"])
        assert mount == "/data" and volume in compose["volumes"]
    assert len({services[n]["volumes"][0] for n in nodes}) == 6  # one volume each

    init = services["redis-cluster-init"]
    assert init["profiles"] == ["cluster"] and init["restart"] == "no"
    assert init["depends_on"] == {n: {"condition": "service_healthy"} for n in nodes}
    script = init["command"][0].replace("$$", "$")  # compose's escape of a literal $
    assert "redis-cli --cluster create" in script
    assert "--cluster-replicas 1 --cluster-yes" in script
    assert all(n in script for n in nodes)
    subprocess.run(["sh", "-n", "-c", script], check=True)  # valid shell

    worker = services["worker-cpu-cluster"]
    assert worker["profiles"] == ["cluster"]
    assert worker["command"] == ["arq", "worker.WorkerSettings"]
    assert worker["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "redis-cluster-init": {"condition": "service_completed_successfully"},
    }
    assert urlsplit(worker["environment"]["LMPOOL_ARQ_REDIS_URL"]).hostname == "redis"
    # the default services stay out of the profile
    for name in ("redis", "worker-gpu", "worker-cpu"):
        assert "profiles" not in services[name]


def test_the_example_producer_asks_for_the_model_the_gpu_worker_serves() -> None:
    """`LMPOOL_MODEL=/models/x docker compose up -d redis worker-gpu`, then `docker compose run
    --rm producer` (the file's own recipe): the producer must ask for the model that worker
    registered, ``LMPOOL_MODEL`` as given (without it, it asked for the bundled default, which
    no worker served, and gave up after LMPOOL_CONNECT_TIMEOUT_S=600)."""
    services = load()["services"]
    for model in ("/models/llama-3-8b", ""):

        def settings(name: str, model: str = model) -> Settings:
            env = {
                k: str(v).replace("${LMPOOL_MODEL:-}", model)
                for k, v in (services[name].get("environment") or {}).items()
            }
            return Settings.from_env(env)

        served = settings("worker-gpu").served_model_name
        assert settings("producer").served_model_name == served, model
