"""Test helpers: worker processes and tiny models (imported by tests, not by conftest)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parent.parent
ARQ = str(Path(sys.executable).parent / "arq")


class WorkerProcess:
    """``arq worker.WorkerSettings`` in a subprocess with the given ``LMPOOL_*`` settings."""

    def __init__(self, redis_url: str, log_dir: Path, **settings: Any) -> None:
        self.redis_url = redis_url
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}
        env.update({"LMPOOL_REDIS_URL": redis_url, "LMPOOL_HEARTBEAT_S": "0.2"})
        env.update({f"LMPOOL_{k.upper()}": str(v) for k, v in settings.items()})
        env["PYTHONUNBUFFERED"] = "1"
        self.env = env
        self.prefix = env.get("LMPOOL_KEY_PREFIX", "lmpool")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"worker-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [ARQ, "worker.WorkerSettings"], env=self.env, cwd=REPO, stdout=log, stderr=log
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def worker_ids(self) -> list[str]:
        r = redis.Redis.from_url(self.redis_url)
        try:
            ids = []
            for key in r.scan_iter(f"{self.prefix}:worker:*"):
                info = r.hget(key, "pid")
                if info is not None and json.loads(info) == self.pid:
                    ids.append(key.decode().split(":", 2)[2])
            return ids
        finally:
            r.close()

    def info(self) -> dict[str, Any]:
        """This worker's heartbeat hash (counters)."""
        r = redis.Redis.from_url(self.redis_url)
        try:
            for wid in self.worker_ids():
                raw = r.hgetall(f"{self.prefix}:worker:{wid}")
                return {k.decode(): json.loads(v) for k, v in raw.items()}
            return {}
        finally:
            r.close()

    def wait_ready(self, timeout_s: float = 120) -> WorkerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited at start:\n{self.log()}")
            if self.worker_ids():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"worker not ready after {timeout_s}s:\n{self.log()}")

    async def wait_counter(self, name: str, at_least: int, timeout_s: float = 10) -> int:
        """Wait until this worker's heartbeat reports ``name >= at_least``; returns the value."""
        deadline = time.monotonic() + timeout_s
        value = 0
        while time.monotonic() < deadline:
            value = int(self.info().get(name, 0))
            if value >= at_least:
                return value
            await asyncio.sleep(0.05)
        return value

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def terminate(self, timeout_s: float = 30) -> int:
        """SIGTERM and wait: the graceful shutdown path."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(timeout_s=15)
            except subprocess.TimeoutExpired:
                self.kill()


def build_tiny_llama(path: Path, vocab_size: int = 320, seed: int = 0) -> Path:
    """A random 2-layer Llama with a byte-level tokenizer, saved as an HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.tokenizer import byte_tokenizer

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=vocab_size - 1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    byte_tokenizer(vocab_size).save_pretrained(path)
    return path
