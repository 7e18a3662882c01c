"""lmpool settings -> vLLM engine arguments, validated before the engine is built.

Everything here runs without vLLM imported (``tests/test_vllm_settings.py`` checks it in any
venv); :func:`engine_kwargs` is the one place where ``LMPOOL_*`` settings become engine
arguments, and :func:`settings_error` turns the engine's own ``ValueError`` at construction into
a ``SettingsError`` that names the ``LMPOOL_`` variable to change.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import SettingsError
from shared.settings import Settings
from worker.backends.vllm.lora import LORA_LINEAR_MODULES, lora_rank

log = logging.getLogger("lmpool.worker")

MB = 1 << 20
HF_ONLY_QUANTIZATIONS = ("8bit", "4bit")
VLLM_QUANTIZATIONS = ("awq", "gptq", "fp8", "bitsandbytes")
COMPATIBLE_METHODS = {
    # lmpool's name -> checkpoint ``quantization_config.quant_method`` values it may load
    "awq": ("awq", "awq_marlin"),
    "gptq": ("gptq", "gptq_marlin"),
    "fp8": ("fp8", "fbgemm_fp8"),
    "bitsandbytes": ("bitsandbytes",),
}
DEFAULT_CPU_KV_SHARE = 0.25
"""``LMPOOL_KV_CACHE_MB=0`` on the CPU: this share of the memory available at start-up..."""
DEFAULT_CPU_KV_MAX_MB = 4096
"""...but at most this much."""
MIN_CPU_KV_MB = 16
CPU_HEADROOM_MB = 512
"""Memory left to everything else when the KV cache is sized from what is available."""


@dataclass(frozen=True)
class Memory:
    """Memory available on the host at start-up (bytes)."""

    available: int
    total: int
    source: str


def _meminfo(path: str, prefix: str = "") -> dict[str, int]:
    values: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if prefix:
                parts = parts[2:]
            if len(parts) >= 2 and parts[0].endswith(":"):
                values[parts[0][:-1]] = int(parts[1]) * 1024
    return values


def available_memory() -> Memory:
    """What the host can give a new allocation: ``MemAvailable`` of /proc/meminfo, and not more
    than vLLM's own reckoning for the NUMA node it binds to (free + file pages + reclaimable
    slab of ``/sys/devices/system/node/node0/meminfo``), nor than the cgroup's limit."""
    info = _meminfo("/proc/meminfo")
    best = Memory(info.get("MemAvailable", info.get("MemFree", 0)), info["MemTotal"], "host")
    node = "/sys/devices/system/node/node0/meminfo"
    if os.path.exists(node):
        n = _meminfo(node, prefix="Node 0")
        node_free = sum(n.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)"))
        node_free += n.get("SReclaimable", 0)
        if node_free < best.available:
            best = Memory(node_free, n.get("MemTotal", best.total), "NUMA node 0")
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < best.total:
            free = int(limit_text) - usage
            if free < best.available:
                best = Memory(max(free, 0), int(limit_text), "cgroup")
        break
    return best


def cpu_kv_cache_bytes(setting_mb: int, memory: Memory | None = None) -> tuple[int, str]:
    """The CPU engine's KV-cache memory and why: ``LMPOOL_KV_CACHE_MB`` when > 0 (an error
    naming it when the host has not that much available), else a quarter of what is available
    (at most 4 GiB), after 512 MiB of headroom."""
    memory = memory or available_memory()
    avail_mb = memory.available // MB
    if setting_mb > 0:
        if setting_mb > avail_mb:
            raise SettingsError(
                f"LMPOOL_KV_CACHE_MB={setting_mb}: only {avail_mb} MiB of memory is available "
                f"({memory.source}); lower it, or set LMPOOL_KV_CACHE_MB=0 to size the vLLM "
                "KV cache from what is free"
            )
        return setting_mb * MB, f"LMPOOL_KV_CACHE_MB={setting_mb}"
    share = int(max(avail_mb - CPU_HEADROOM_MB, 0) * DEFAULT_CPU_KV_SHARE)
    chosen = min(share, DEFAULT_CPU_KV_MAX_MB)
    if chosen < MIN_CPU_KV_MB:
        raise SettingsError(
            f"only {avail_mb} MiB of memory is available ({memory.source}): too little for "
            "a vLLM KV cache; free memory or set LMPOOL_KV_CACHE_MB explicitly"
        )
    why = (
        f"LMPOOL_KV_CACHE_MB=0: {DEFAULT_CPU_KV_SHARE:.0%} of the {avail_mb} MiB available "
        f"({memory.source}) less {CPU_HEADROOM_MB} MiB, at most {DEFAULT_CPU_KV_MAX_MB} MiB"
    )
    return chosen * MB, why


def check_device(setting: str, device_type: str) -> None:
    """vLLM runs on the platform it was built for; ``LMPOOL_DEVICE`` may only agree with it."""
    if setting == "auto":
        return
    kind, _, index = setting.partition(":")
    if kind != device_type:
        raise SettingsError(
            f"LMPOOL_DEVICE={setting}, but this vLLM build runs on {device_type} "
            f"(set LMPOOL_DEVICE=auto or {device_type})"
        )
    if index not in ("", "0"):
        raise SettingsError(
            f"LMPOOL_DEVICE={setting}: vLLM uses the first visible device; "
            f"set CUDA_VISIBLE_DEVICES={index} and LMPOOL_DEVICE={kind}"
        )


def model_config(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


def model_max_len(config: dict[str, Any]) -> int | None:
    """The context length in the model's config.json, when it states one plainly (no rope
    scaling, which vLLM accounts for itself)."""
    if config.get("rope_scaling"):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_max_model_len(setting: int, config: dict[str, Any]) -> None:
    own = model_max_len(config)
    if setting and own is not None and setting > own:
        raise SettingsError(
            f"LMPOOL_MAX_MODEL_LEN={setting} exceeds the model's context of {own} tokens "
            "(max_position_embeddings in its config.json); set at most that, or 0 for the "
            "model's own"
        )


def check_quantization(
    setting: str, config: dict[str, Any], supported: Iterable[str] | None = None
) -> str | None:
    """vLLM's ``quantization`` argument for ``LMPOOL_QUANTIZATION`` (None: from the checkpoint).

    ``supported``: the methods this vLLM knows (``vllm...quantization.QUANTIZATION_METHODS``).
    """
    if setting in ("", "none"):
        return None
    if setting in HF_ONLY_QUANTIZATIONS:
        raise SettingsError(
            f"LMPOOL_QUANTIZATION={setting} is the hf backend's bitsandbytes mode; the vllm "
            "backend takes awq, gptq or fp8 (pre-quantized checkpoints, or fp8 quantized while "
            "loading) or bitsandbytes (4-bit, quantized while loading); or use LMPOOL_BACKEND=hf"
        )
    if setting not in VLLM_QUANTIZATIONS:
        raise SettingsError(
            f"LMPOOL_QUANTIZATION={setting} is not a vllm quantization; use one of "
            f"{', '.join(VLLM_QUANTIZATIONS)}"
        )
    known = set(supported) if supported is not None else None
    if known is not None and setting not in known:
        try:
            from vllm import __version__ as version
        except ImportError:  # pragma: no cover
            version = "?"
        raise SettingsError(
            f"LMPOOL_QUANTIZATION={setting}: this vLLM ({version}) has no {setting} "
            f"quantization; use one of {', '.join(q for q in VLLM_QUANTIZATIONS if q in known)}"
        )
    quant = config.get("quantization_config")
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    if method and method not in COMPATIBLE_METHODS[setting]:
        raise SettingsError(
            f"LMPOOL_QUANTIZATION={setting}, but the checkpoint is quantized with {method} "
            f"(quantization_config in its config.json); set LMPOOL_QUANTIZATION=none to load "
            "it as it is"
        )
    if not method and setting in ("awq", "gptq"):
        raise SettingsError(
            f"LMPOOL_QUANTIZATION={setting} needs a checkpoint quantized with {setting} (its "
            "config.json has no quantization_config); quantize it first, or use fp8 or "
            "bitsandbytes, which quantize while loading"
        )
    return setting


def check_tensor_parallel(setting: int, device_type: str, devices: int) -> None:
    if setting > 1 and setting > devices:
        what = "GPUs are visible" if device_type == "cuda" else "CPU cores are usable"
        raise SettingsError(
            f"LMPOOL_TENSOR_PARALLEL_SIZE={setting}, but only {devices} {what}; "
            f"set at most {devices}"
        )


def eager(setting: str, device_type: str) -> bool:
    if setting == "auto":
        return device_type == "cpu"  # torch.compile on the CPU costs minutes at start-up
    return setting == "true"


def engine_kwargs(
    settings: Settings,
    device_type: str,
    adapters: dict[str, str],
    *,
    config: dict[str, Any] | None = None,
    devices: int = 1,
    quantizations: Iterable[str] | None = None,
    memory: Memory | None = None,
) -> dict[str, Any]:
    """vLLM engine arguments for ``settings``: each lmpool setting mapped here, checked where
    it can be before the engine starts, then ``LMPOOL_ENGINE_OPTIONS`` over them all.

    ``config``: the checkpoint's config.json; ``devices``: GPUs visible (cuda) or CPU cores
    usable (cpu); ``quantizations``: the methods this vLLM supports.
    """
    config = config or {}
    options = settings.engine_kwargs()
    check_device(settings.device, device_type)
    dtype = settings.dtype
    if dtype == "auto":
        # float32 on CPU like the hf backend; on GPU vLLM's own choice from the checkpoint.
        dtype = "float32" if device_type == "cpu" else "auto"
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "enable_prefix_caching": bool(settings.prefix_caching),
        "enforce_eager": eager(settings.enforce_eager, device_type),
        "tensor_parallel_size": settings.tensor_parallel_size,
        "disable_log_stats": True,
        # interactive works (priority 0) are scheduled before offline ones (1)
        "scheduling_policy": "priority",
    }
    if "tensor_parallel_size" not in options:
        check_tensor_parallel(settings.tensor_parallel_size, device_type, devices)
    if settings.max_model_len:
        if "max_model_len" not in options:
            check_max_model_len(settings.max_model_len, config)
        kwargs["max_model_len"] = settings.max_model_len
    if "quantization" not in options:
        quantization = check_quantization(settings.quantization, config, quantizations)
        if quantization is not None:
            kwargs["quantization"] = quantization
    if device_type == "cpu":
        if not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(options):
            kv_bytes, why = cpu_kv_cache_bytes(settings.kv_cache_mb, memory)
            kwargs["kv_cache_memory_bytes"] = kv_bytes
            log.info("vLLM KV cache on the CPU: %d MiB (%s)", kv_bytes // MB, why)
            if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                log.info(
                    "VLLM_CPU_KVCACHE_SPACE=%s GiB is set and takes precedence in vLLM",
                    os.environ["VLLM_CPU_KVCACHE_SPACE"],
                )
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if adapters:
        kwargs.update(
            enable_lora=True,
            max_loras=len(adapters),
            max_lora_rank=lora_rank(adapters) if "max_lora_rank" not in options else None,
        )
        if kwargs["max_lora_rank"] is None:
            del kwargs["max_lora_rank"]
    if adapters or options.get("enable_lora"):
        kwargs["lora_target_modules"] = list(LORA_LINEAR_MODULES)
    kwargs.update(options)
    if device_type == "cuda" and kwargs.get("enable_lora") and is_float32(kwargs["dtype"]):
        # vLLM's LoRA kernels (Triton, punica) assert float16 or bfloat16 inputs on CUDA: the
        # engine core would die at its first LoRA forward (seen on an H100).
        raise SettingsError(
            "LMPOOL_DTYPE=float32 with LoRA adapters (LMPOOL_LORA) on CUDA: vLLM's LoRA kernels "
            "take float16 or bfloat16 there; set LMPOOL_DTYPE=float16, bfloat16 or auto"
        )
    return kwargs


def is_float32(dtype: Any) -> bool:
    """``dtype`` (a setting's string or a torch dtype from LMPOOL_ENGINE_OPTIONS) is float32."""
    return str(dtype).removeprefix("torch.") in ("float32", "float")


# -- the engine's own errors -> the setting to change ----------------------------------------
_PATTERNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("max_model_len", "max model len", "max_position_embeddings"), "max_model_len"),
    (("tensor_parallel", "world_size", "world size"), "tensor_parallel_size"),
    (("quantiz", "quant_method"), "quantization"),
    (("lora",), "lora"),
    (("kv_cache_memory", "kv cache", "kvcache"), "kv_cache_mb"),
    (
        ("gpu_memory_utilization", "memory utilization", "available memory"),
        "gpu_memory_utilization",
    ),
    (("dtype", "bfloat16", "float16"), "dtype"),
    (("prefix_caching", "prefix caching"), "prefix_caching"),
    (("enforce_eager", "cuda graph", "cudagraph"), "enforce_eager"),
)


def settings_error(
    error: BaseException, settings: Settings, device_type: str
) -> SettingsError | None:
    """A ``SettingsError`` naming the ``LMPOOL_`` setting behind vLLM's ``error``, or None when
    no setting is recognizably at fault."""
    message = str(error).strip()
    low = message.lower()
    options = settings.engine_kwargs()
    for key in options:
        if key.lower() in low:
            return SettingsError(
                f"LMPOOL_ENGINE_OPTIONS ({key}={options[key]!r}) was refused by vLLM: "
                f"{_first_lines(message)}"
            )
    for needles, name in _PATTERNS:
        if any(n in low for n in needles):
            if name == "gpu_memory_utilization" and device_type == "cpu":
                name = "kv_cache_mb"
            value = getattr(settings, name)
            return SettingsError(
                f"LMPOOL_{name.upper()}={value}: vLLM refused it: {_first_lines(message)}"
            )
    return None


def _first_lines(message: str, limit: int = 600) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
