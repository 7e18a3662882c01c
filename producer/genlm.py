"""genlm-backend's type checks accept a ``RemoteLM``: it is registered as a virtual subclass of
``AsyncLM`` and ``AsyncTransformer`` (whose hf-style KV-cache methods it provides; llamppl's
``CachedCausalLM`` asks for one of those) as soon as ``genlm.backend.llm`` is imported, or at
once if it already is, so a program that never imports genlm-backend does not pay for it
(seconds)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

GENLM_LLM = "genlm.backend.llm"


def register_with_genlm(cls: type) -> None:
    """Register ``cls`` now, or when ``genlm.backend.llm`` gets imported."""
    if GENLM_LLM in sys.modules:
        _register(sys.modules[GENLM_LLM], cls)
    else:
        sys.meta_path.insert(0, _RegisterOnImport(cls))


def _register(llm_module: Any, cls: type) -> None:
    llm_module.AsyncLM.register(cls)
    llm_module.AsyncTransformer.register(cls)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Wraps the loading of ``genlm.backend.llm`` to register a class right after it."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self._looking = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != GENLM_LLM or getattr(self._looking, "now", False):
            return None
        self._looking.now = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._looking.now = False
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _register(module, self.cls)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
