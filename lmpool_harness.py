"""Registers lmpool's model with lm-evaluation-harness when lm-eval loads its models.

lm-eval 0.4.13 finds models only in its own registry (no plugin entry points), so
``lm_eval --model lmpool`` could not find ours without an import by the user. The installed
package ships ``lmpool_harness.pth``, which Python runs at start-up: it imports this module,
which only puts a finder on ``sys.meta_path`` (no other import, nothing else at start-up). When
``lm_eval.models`` is imported, its loader runs as usual and then ``lmpool`` is registered as a
lazy entry, ``producer.harness:LMPoolLM``, which lm-eval imports when it is asked for. The
finder leaves ``sys.meta_path`` after that one import.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

TARGET = "lm_eval.models"
NAME, ENTRY = "lmpool", "producer.harness:LMPoolLM"


def register() -> None:
    """Add ``lmpool`` to lm-eval's model registry, lazily, unless it is there already."""
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=ENTRY)


class _Finder:
    """Finds ``lm_eval.models`` as Python would and wraps its loader's ``exec_module``."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        remove()
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                register()
            except Exception as e:  # never break lm-eval's own import
                print(f"lmpool could not register with lm-eval: {e}", file=sys.stderr)

        loader.exec_module = exec_module
        return spec


_FINDER = _Finder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once); register at once if lm-eval's models
    are already loaded."""
    if TARGET in sys.modules:
        register()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def remove() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


install()
