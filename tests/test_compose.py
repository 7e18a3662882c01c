"""docker-compose.yml against the settings module (no Docker engine runs here)."""

from __future__ import annotations

from pathlib import Path

import yaml

from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_their_commands() -> None:
    services = load()["services"]
    assert {"redis", "worker-gpu", "worker-cpu", "producer"} <= set(services)
    for name in ("worker-gpu", "worker-cpu"):
        assert services[name]["command"] == ["arq", "worker.WorkerSettings"]
    assert services["producer"]["command"][:3] == ["python", "-m", "producer.demo"]
    assert (ROOT / "producer" / "demo.py").exists()


def test_every_lmpool_variable_is_a_valid_setting() -> None:
    for name, service in load()["services"].items():
        env = {
            k: ("" if "${" in str(v) else str(v))
            for k, v in (service.get("environment") or {}).items()
        }
        settings = Settings.from_env(env)  # unknown or invalid LMPOOL_ variables raise
        if name.startswith("worker"):
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
