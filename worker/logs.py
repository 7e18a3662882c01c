"""Logging set-up shared by workers and command-line tools.

``LMPOOL_LOG_FORMAT=json`` writes one JSON object per line (time, level, logger, pid, message,
and any ``extra`` fields such as ``digest`` and ``worker``) for log collectors; ``text`` (the
default) writes the same on one human-readable line.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the ``lmpool`` loggers; idempotent."""
    root = logging.getLogger("lmpool")
    root.setLevel(level.upper())
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
        )
    root.addHandler(handler)
    root.propagate = False


def arq_log_config(verbose: bool) -> dict[str, Any]:
    """arq's own logging configuration (``arq.logs.default_log_config``, which its CLI applies
    once it has imported the worker's settings) with lines in JSON, as lmpool's."""
    from arq.logs import default_log_config

    config = default_log_config(verbose)
    config["formatters"]["arq.standard"] = {"()": JsonFormatter}
    return config
