"""GPU-node side of lmpool: run ``arq worker.WorkerSettings``."""

from worker.app import WorkerSettings

__all__ = ["WorkerSettings"]
