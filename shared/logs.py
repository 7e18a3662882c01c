"""Logging set-up shared by workers and command-line tools."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO") -> None:
    """One line per record with time, process and logger; idempotent."""
    root = logging.getLogger("lmpool")
    if root.handlers:
        root.setLevel(level.upper())
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
