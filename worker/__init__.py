"""GPU-node side of lmpool: run ``arq worker.WorkerSettings``.

``WorkerSettings`` is imported on first use, so that ``worker.model_files`` and the other
modules do not pay for the whole worker (torch, transformers, the offline scorer).
"""

import os
from typing import Any

__all__ = ["WorkerSettings"]


def __getattr__(name: str) -> Any:
    if name == "WorkerSettings":
        # No progress bar between a serving worker's log lines (the bundled model's conversion
        # at a machine's first start): tqdm reads TQDM_DISABLE once, when worker.app imports it
        os.environ.setdefault("TQDM_DISABLE", "1")
        from worker.app import WorkerSettings

        return WorkerSettings
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
