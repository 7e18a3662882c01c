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
    error, found before any weights load (the engines check their devices themselves).

    Its fingerprint covers the files of the ``LMPOOL_LORA`` adapters (requests name them by
    name: other weights under a name are other answers) and names ``LMPOOL_WIRE_DTYPE`` where
    that rounds the rows the model computes (a float32 model's, in float16): other answers,
    so other cache entries, and a worker that differs is refused beside a live one under one
    model name."""
    backend = _build(settings)
    info = backend.info
    adapters = settings.lora_adapters()
    if adapters:
        info["fingerprint"] = f"{info['fingerprint']}-lora{adapters_fingerprint(adapters)}"
    if wire_rounds(info["dtype"], settings.wire_dtype):
        info["fingerprint"] = f"{info['fingerprint']}-wire{settings.wire_dtype}"
    return backend


def adapters_fingerprint(adapters: dict[str, str]) -> str:
    """Identity of start-up adapters: each name with its files' fingerprint (its path as given
    where no local files are found)."""
    import hashlib
    from pathlib import Path

    from worker.backends.model_files import files_fingerprint

    h = hashlib.blake2b(digest_size=8)
    for name, path in sorted(adapters.items()):
        local = Path(path).expanduser()
        content = files_fingerprint(local) if local.exists() else f"path:{path}"
        h.update(f"{name}\x00{content}\x00".encode())
    return h.hexdigest()


def wire_rounds(dtype: str, wire: str) -> bool:
    """Whether rows computed in ``dtype`` are rounded on their way in ``wire`` (see
    ``shared.protocol.sent_dtype``)."""
    from shared.codec import torch_dtype
    from shared.errors import ProtocolError
    from shared.protocol import sent_dtype

    try:
        return sent_dtype(torch_dtype(dtype), torch_dtype(wire)) is not None
    except ProtocolError:  # a dtype the wire has no name for: rounded unless float32
        return wire != "float32"


def _build(settings: Settings) -> Backend:
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
