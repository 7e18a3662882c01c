"""GPU-node side of lmpool: run ``arq worker.WorkerSettings``.

``WorkerSettings`` is imported on first use, so that ``worker.model_files`` and the other
modules do not pay for the whole worker (torch, transformers, the offline scorer).
"""

from typing import Any

__all__ = ["WorkerSettings"]


def __getattr__(name: str) -> Any:
    if name == "WorkerSettings":
        from worker.app import WorkerSettings

        return WorkerSettings
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
