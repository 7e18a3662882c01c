"""Fixtures of the conformance suite: one model on disk, two subjects that serve it.

- ``reference``: genlm-backend 0.3.1's in-process ``AsyncTransformer`` over the transformers
  model loaded from the files;
- ``pool``: ``producer.RemoteLM`` connected to a live pool: the session's private Redis server
  and one hf worker process (float32 on the CPU) on the same files.

``lm`` is a fresh object of the test's subject (parametrized over both); ``other`` is one of the
other subject; ``subjects.make(name)`` builds more. The worker starts once for the package, on
the first test that needs the pool, and stops after the package's last test, so no worker of
this suite outlives it (other test files count keys and workers on the same server).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from poolkit import WorkerProcess, build_adapter, build_tiny_llama

from localpool.redis_server import RedisServer

from .kit import MODEL_SHAPE, SUBJECTS

MODEL_NAME = "conformance-tiny-llama"
TIMEOUT_S = 20.0
"""Each pool request's timeout: far above any answer here, far below the test timeout."""


@dataclass(frozen=True)
class Files:
    model: Path
    adapter: Path


@dataclass
class Pool:
    url: str
    model: str
    worker: WorkerProcess

    def connect(self, **kwargs: Any) -> Any:
        """A new ``RemoteLM`` of the pool, built without an event loop (genlm's ``from_name``)."""
        from producer import RemoteLM

        kwargs.setdefault("timeout_s", TIMEOUT_S)
        return RemoteLM.from_name(self.model, redis_url=self.url, connect_timeout_s=60, **kwargs)


def load_model(files: Files) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(files.model, dtype=torch.float32).eval()


@pytest.fixture(scope="package")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("conformance")
    return Files(build_tiny_llama(root / "model", **MODEL_SHAPE), build_adapter(root / "adapter"))


@pytest.fixture(scope="package")
def hf_model(files: Files) -> Any:
    """The model for direct forwards (``kit.direct``); never given an adapter."""
    return load_model(files)


@pytest.fixture(scope="package")
def reference_model(files: Files) -> Any:
    """The model under the reference subjects (LoRA tests give theirs a model of their own)."""
    return load_model(files)


@pytest.fixture(scope="package")
def tokenizer(files: Files) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.model)


@pytest.fixture(scope="package")
def pool(
    redis_server: RedisServer, files: Files, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    """One hf worker on the session's Redis server (never flushed while it runs)."""
    worker = WorkerProcess(
        redis_server.url,
        tmp_path_factory.mktemp("conformance-logs"),
        backend="hf",
        model=str(files.model),
        model_name=MODEL_NAME,
        device="cpu",
        dtype="float32",
        torch_threads=1,
    ).start()
    try:
        worker.wait_ready()
        yield Pool(redis_server.url, MODEL_NAME, worker)
    finally:
        worker.stop()


class Subjects:
    """Builds subjects by name and closes the pool's at teardown."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request
        self.made: list[Any] = []

    def make(self, name: str, own_model: bool = False, **kwargs: Any) -> Any:
        """A new object of subject ``name``; ``own_model``: the reference gets a model of its
        own (LoRA adapters change the model they are loaded into)."""
        if name == "reference":
            from genlm.backend.llm import AsyncTransformer

            if own_model:
                model = load_model(self.request.getfixturevalue("files"))
            else:
                model = self.request.getfixturevalue("reference_model")
            lm = AsyncTransformer(model, self.request.getfixturevalue("tokenizer"), **kwargs)
        elif name == "pool":
            lm = self.request.getfixturevalue("pool").connect(**kwargs)
        else:
            raise ValueError(name)
        self.made.append(lm)
        return lm

    def close(self) -> None:
        for lm in self.made:
            if hasattr(lm, "cleanup"):
                lm.cleanup()


@pytest.fixture(params=SUBJECTS)
def subject(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def subjects(request: pytest.FixtureRequest) -> Iterator[Subjects]:
    made = Subjects(request)
    yield made
    made.close()


@pytest.fixture
def lm(subject: str, subjects: Subjects) -> Any:
    """A fresh object of this test's subject."""
    return subjects.make(subject)


@pytest.fixture
def other(subject: str, subjects: Subjects) -> Any:
    """A fresh object of the other subject (for cross-subject equality)."""
    return subjects.make(next(s for s in SUBJECTS if s != subject))
