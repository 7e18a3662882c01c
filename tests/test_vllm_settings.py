"""lmpool settings -> vLLM engine arguments, and the start-up errors that name the setting.

The mapping and its checks (``worker/backends/vllm/engine_args.py``) run without vLLM, in any
venv; the tests at the end build a ``VLLMBackend`` and need vLLM (``make test-vllm``). Those
stop before the engine's processes start, except one that lets vLLM itself refuse a value.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from shared.errors import SettingsError
from shared.settings import Settings
from worker.backends.vllm import engine_args as ea

GIB = 1 << 30
PLENTY = ea.Memory(available=20 * GIB, total=24 * GIB, source="test")
QUANTS = ("awq", "gptq", "fp8")  # vLLM 0.32's among lmpool's: no bitsandbytes
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vLLM here")


def kwargs(platform: str = "cpu", adapters: dict[str, str] | None = None, **settings: Any) -> Any:
    return ea.engine_kwargs(
        Settings(backend="vllm", **settings),
        platform,
        adapters or {},
        config={"max_position_embeddings": 256},
        devices=2,
        quantizations=QUANTS,
        memory=PLENTY,
    )


def adapter(path: Path, r: int = 8, targets: Any = ("q_proj", "v_proj")) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"r": r, "lora_alpha": 16, "target_modules": list(targets)}
    if isinstance(targets, str):
        config["target_modules"] = targets
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


# -- the mapping -------------------------------------------------------------------------------
def test_defaults_on_the_cpu() -> None:
    k = kwargs()
    assert k["dtype"] == "float32" and k["enforce_eager"] is True
    assert k["enable_prefix_caching"] is True and k["tensor_parallel_size"] == 1
    assert k["kv_cache_memory_bytes"] == 512 * ea.MB  # LMPOOL_KV_CACHE_MB's default
    assert k["scheduling_policy"] == "priority"
    assert "gpu_memory_utilization" not in k and "max_model_len" not in k
    assert "quantization" not in k and "enable_lora" not in k


def test_defaults_on_a_gpu() -> None:
    k = kwargs("cuda")
    assert k["dtype"] == "auto" and k["enforce_eager"] is False
    assert k["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in k


def test_each_setting_maps_to_its_engine_argument() -> None:
    k = kwargs(
        "cuda",
        gpu_memory_utilization=0.5,
        max_model_len=128,
        tensor_parallel_size=2,
        enforce_eager="true",
        prefix_caching=False,
        quantization="fp8",
        dtype="bfloat16",
    )
    assert k["gpu_memory_utilization"] == 0.5 and k["max_model_len"] == 128
    assert k["tensor_parallel_size"] == 2 and k["enforce_eager"] is True
    assert k["enable_prefix_caching"] is False and k["quantization"] == "fp8"
    assert k["dtype"] == "bfloat16"
    assert kwargs("cpu", enforce_eager="false")["enforce_eager"] is False


def test_engine_options_override_everything() -> None:
    options = {"max_model_len": 64, "kv_cache_memory_bytes": 1234, "enable_prefix_caching": True}
    k = kwargs(engine_options=json.dumps(options), max_model_len=100, prefix_caching=False)
    assert k["max_model_len"] == 64 and k["kv_cache_memory_bytes"] == 1234
    assert k["enable_prefix_caching"] is True
    # an option that vLLM checks itself skips lmpool's check of the same thing
    k = kwargs("cuda", engine_options='{"tensor_parallel_size": 8}', tensor_parallel_size=8)
    assert k["tensor_parallel_size"] == 8


def test_lora_arguments(tmp_path: Path) -> None:
    k = kwargs(
        adapters={"a": str(adapter(tmp_path / "a", r=8)), "b": str(adapter(tmp_path / "b", r=24))}
    )
    assert k["enable_lora"] is True and k["max_loras"] == 2 and k["max_lora_rank"] == 32
    assert "lm_head" not in k["lora_target_modules"] and "q_proj" in k["lora_target_modules"]
    all_linear = adapter(tmp_path / "c", targets="all-linear")
    assert kwargs(adapters={"c": str(all_linear)})["max_lora_rank"] == 8


# -- the errors, each naming its setting ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["8bit", "4bit"])
def test_hf_quantization_modes_are_refused_with_the_vllm_ones_named(mode: str) -> None:
    with pytest.raises(SettingsError, match=f"LMPOOL_QUANTIZATION={mode}.*hf backend.*awq"):
        kwargs(quantization=mode)


def test_a_quantization_this_vllm_lacks() -> None:
    with pytest.raises(SettingsError, match="LMPOOL_QUANTIZATION=bitsandbytes: this vLLM"):
        kwargs(quantization="bitsandbytes")


def test_quantization_against_the_checkpoint() -> None:
    quantized = {"quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(SettingsError, match=r"LMPOOL_QUANTIZATION=awq.*quantized with gptq"):
        ea.check_quantization("awq", quantized, QUANTS)
    assert ea.check_quantization("gptq", quantized, QUANTS) == "gptq"
    assert ea.check_quantization("none", quantized, QUANTS) is None  # vLLM reads the config
    with pytest.raises(SettingsError, match="LMPOOL_QUANTIZATION=awq needs a checkpoint"):
        ea.check_quantization("awq", {}, QUANTS)
    assert ea.check_quantization("fp8", {}, QUANTS) == "fp8"  # quantized while loading


def test_max_model_len_beyond_the_model() -> None:
    with pytest.raises(SettingsError, match=r"LMPOOL_MAX_MODEL_LEN=300 exceeds.*256"):
        kwargs(max_model_len=300)
    assert kwargs(max_model_len=256)["max_model_len"] == 256
    # rope scaling: vLLM works the length out itself
    ea.check_max_model_len(10_000, {"max_position_embeddings": 256, "rope_scaling": {"f": 4}})


def test_tensor_parallel_beyond_the_devices() -> None:
    with pytest.raises(SettingsError, match=r"LMPOOL_TENSOR_PARALLEL_SIZE=4.*only 2 GPUs"):
        kwargs("cuda", tensor_parallel_size=4)
    with pytest.raises(SettingsError, match=r"LMPOOL_TENSOR_PARALLEL_SIZE=3.*CPU cores"):
        kwargs("cpu", tensor_parallel_size=3)


def test_device_must_match_the_vllm_build() -> None:
    with pytest.raises(SettingsError, match=r"LMPOOL_DEVICE=cuda.*runs on cpu"):
        kwargs("cpu", device="cuda")
    with pytest.raises(SettingsError, match="CUDA_VISIBLE_DEVICES=1"):
        kwargs("cuda", device="cuda:1")
    kwargs("cuda", device="cuda:0")


def test_lora_rank_and_targets(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="LMPOOL_LORA: LoRA rank 1024 exceeds"):
        kwargs(adapters={"big": str(adapter(tmp_path / "big", r=1024))})
    with pytest.raises(SettingsError, match="LMPOOL_LORA: LoRA adapter h targets lm_head"):
        kwargs(adapters={"h": str(adapter(tmp_path / "h", targets=["q_proj", "lm_head"]))})
    with pytest.raises(SettingsError, match="LMPOOL_LORA: LoRA adapter x: cannot read r"):
        kwargs(adapters={"x": str(tmp_path / "missing")})


def test_kv_cache_memory_on_the_cpu() -> None:
    small = ea.Memory(available=2 * GIB, total=8 * GIB, source="test")
    with pytest.raises(SettingsError, match="LMPOOL_KV_CACHE_MB=4096: only 2048 MiB"):
        ea.cpu_kv_cache_bytes(4096, small)
    assert ea.cpu_kv_cache_bytes(1024, small)[0] == 1024 * ea.MB
    chosen, why = ea.cpu_kv_cache_bytes(0, small)
    assert chosen == (2048 - 512) // 4 * ea.MB and "LMPOOL_KV_CACHE_MB=0" in why
    assert ea.cpu_kv_cache_bytes(0, PLENTY)[0] == 4096 * ea.MB  # capped
    with pytest.raises(SettingsError, match="too little"):
        ea.cpu_kv_cache_bytes(0, ea.Memory(available=520 * ea.MB, total=GIB, source="test"))
    memory = ea.available_memory()  # this host
    assert 0 < memory.available <= memory.total


def test_engine_errors_are_mapped_to_settings() -> None:
    s = Settings(backend="vllm", max_model_len=4096)
    e = ValueError("User-specified max_model_len (4096) is greater than the derived max_model_len")
    mapped = ea.settings_error(e, s, "cpu")
    assert mapped is not None and "LMPOOL_MAX_MODEL_LEN=4096" in str(mapped)
    mapped = ea.settings_error(ValueError("Available memory on node 0 is less"), s, "cpu")
    assert mapped is not None and str(mapped).startswith("LMPOOL_KV_CACHE_MB=")
    mapped = ea.settings_error(ValueError("Available memory on node 0 is less"), s, "cuda")
    assert mapped is not None and str(mapped).startswith("LMPOOL_GPU_MEMORY_UTILIZATION=")
    s = Settings(backend="vllm", engine_options='{"max_num_seqs": -1}')
    mapped = ea.settings_error(ValueError("max_num_seqs must be positive"), s, "cpu")
    assert mapped is not None and "LMPOOL_ENGINE_OPTIONS (max_num_seqs=-1)" in str(mapped)
    assert ea.settings_error(ValueError("something else entirely"), s, "cpu") is None


# -- through the backend (vLLM installed) --------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from poolkit import build_model

    return build_model(tmp_path_factory.mktemp("vllm-settings-model"))


@needs_vllm
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"quantization": "8bit"}, "LMPOOL_QUANTIZATION=8bit is the hf backend's"),
        ({"max_model_len": 1024}, "LMPOOL_MAX_MODEL_LEN=1024 exceeds the model's context of 256"),
        ({"tensor_parallel_size": 64}, "LMPOOL_TENSOR_PARALLEL_SIZE=64"),
        ({"device": "cuda"}, "LMPOOL_DEVICE=cuda"),
        ({"kv_cache_mb": 10_000_000}, "LMPOOL_KV_CACHE_MB=10000000: only"),
        ({"engine_options": '{"no_such_option": 1}'}, "LMPOOL_ENGINE_OPTIONS: not a vLLM engine"),
        # vLLM's own check, in this process: its ValueError comes back naming the setting
        ({"engine_options": '{"max_model_len": 100000}'}, r"LMPOOL_ENGINE_OPTIONS \(max_model_len"),
        ({"engine_options": '{"worker_extension_cls": "x.Y"}'}, "worker_extension_cls is taken"),
    ],
)
def test_backend_start_up_errors_name_the_setting(
    model_dir: Path, settings: dict[str, Any], message: str
) -> None:
    from worker.backends.vllm import VLLMBackend

    with pytest.raises(SettingsError, match=message):
        VLLMBackend(Settings(backend="vllm", model=str(model_dir), **settings))


@needs_vllm
def test_a_lora_rank_beyond_vllm_fails_before_the_engine(model_dir: Path, tmp_path: Path) -> None:
    from worker.backends.vllm import VLLMBackend

    big = adapter(tmp_path / "big", r=1024)
    with pytest.raises(SettingsError, match="LMPOOL_LORA: LoRA rank 1024"):
        VLLMBackend(Settings(backend="vllm", model=str(model_dir), lora=f"big={big}"))


@pytest.mark.parametrize(
    ("which", "name", "value"),
    [
        ("SPAWN_ENGINE_CORE", "VLLM_WORKER_MULTIPROC_METHOD", "spawn"),
        ("EXACT_FLOAT32", "TRITON_F32_DEFAULT", "ieee"),
    ],
)
def test_engine_environment_on_cuda_unless_the_operator_chose(
    which: str, name: str, value: str
) -> None:
    """A forked engine core dies once the parent touched CUDA, and vLLM's Triton attention
    rounds float32 to TF32 by default (both seen on an H100): on CUDA the backend sets
    ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` and, for float32, ``TRITON_F32_DEFAULT=ieee``,
    each unless the operator set it."""
    from worker.backends.vllm import engine

    setting = getattr(engine, which)
    env: dict[str, str] = {}
    assert engine.unless_chosen(env, setting) is True
    assert env == {name: value}
    chosen = {name: "operator's"}
    assert engine.unless_chosen(chosen, setting) is False
    assert chosen == {name: "operator's"}


def test_lora_in_float32_on_cuda_is_refused_before_the_engine(tmp_path: Path) -> None:
    """vLLM's LoRA kernels on CUDA assert float16 or bfloat16 (its engine core died at the
    first LoRA forward on an H100); on the CPU float32 LoRA is vLLM's own path."""
    adapters = {"a": str(adapter(tmp_path / "a"))}
    with pytest.raises(SettingsError, match=r"LMPOOL_DTYPE=float32 with LoRA.*float16, bfloat16"):
        kwargs("cuda", adapters, dtype="float32")
    with pytest.raises(SettingsError, match="LMPOOL_DTYPE=float32"):
        kwargs("cuda", engine_options='{"enable_lora": true, "dtype": "float32"}')
    assert kwargs("cuda", adapters, dtype="float16")["enable_lora"] is True
    assert kwargs("cuda", adapters)["dtype"] == "auto"
    assert kwargs("cpu", adapters, dtype="float32")["dtype"] == "float32"
    assert ea.is_float32("torch.float32") and not ea.is_float32("bfloat16")
