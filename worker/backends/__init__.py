"""Backend factory: ``load_backend(settings)`` picks and builds the configured engine."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from shared.errors import SettingsError
from shared.settings import Settings

if TYPE_CHECKING:  # the engines (and torch) load only when a backend is chosen
    from worker.backends.base import Backend


def choose_backend(settings: Settings) -> str:
    """genlm-backend's rule: vllm when CUDA and vLLM are present, else hf."""
    if settings.backend != "auto":
        return settings.backend
    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return "hf"


def load_backend(settings: Settings) -> Backend:
    """The configured backend. An engine that is not installed raises ``ImportError`` with
    the extra to install; transformers asked for a CUDA device torch does not see is a setting
    error, found before any weights load (the engines check their devices themselves)."""
    name = choose_backend(settings)
    if name == "hf" and settings.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SettingsError(
                f"LMPOOL_DEVICE={settings.device}, but torch {torch.__version__} sees no CUDA "
                "device here: set LMPOOL_DEVICE=cpu (or auto), or install torch's CUDA build"
            )
    if name == "mock":
        from worker.backends.mock import MockBackend

        return MockBackend(
            settings.mock_vocab_size,
            fail_on=settings.id_list("mock_fail_on"),
            crash_on=settings.id_list("mock_crash_on"),
            delay_ms=settings.mock_delay_ms,
        )
    if name == "hf":
        from worker.backends.hf import HFBackend

        return HFBackend(settings)
    if name == "vllm":
        from worker.backends.vllm import VLLMBackend

        return VLLMBackend(settings)
    if name == "sglang":
        from worker.backends.sglang import SGLangBackend

        return SGLangBackend(settings)
    raise SettingsError(f"LMPOOL_BACKEND={name} is not available in this build")


__all__ = ["choose_backend", "load_backend"]
