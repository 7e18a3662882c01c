"""SGLang backend: SGLang's scheduler in this process, driven by genlm-backend's
``AsyncSGLTransformer`` (its ``batch_next_token_logprobs_sync`` takes the full-vocabulary
log-probs straight from the logits of each scheduled batch).

SGLang needs CUDA (its kernels ship for sm90/sm100), so this module stays small: it adapts that
engine to lmpool's backend interface. ``score`` asks for the rows of every continuation prefix
in one call (SGLang's radix cache makes the shared prefix cheap). ``sample`` is the base class's
scheduler: the running generations decode together, one ``logprobs`` call (one engine call) per
step for all of them, each token drawn with its own seeded generator. Install with
``pip install lmpool[sglang]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.errors import SettingsError
from shared.settings import Settings
from worker.backends.base import Backend, describe_model
from worker.backends.model_files import eos_token_ids, model_dir, quantized
from worker.backends.rows import with_greedy

log = logging.getLogger("lmpool.worker")
INSTALL_HINT = "the sglang backend needs SGLang and genlm-backend: pip install lmpool[sglang]"


QUANTIZATIONS = {"none": None, "awq": "awq", "gptq": "gptq", "fp8": "fp8"}


def engine_options(settings: Settings) -> dict[str, Any]:
    """SGLang ``ServerArgs`` for lmpool's settings, ``LMPOOL_ENGINE_OPTIONS`` over them all.

    Each setting that says it applies to sglang is mapped here; what this backend cannot do
    fails at start-up instead of being ignored.
    """
    if settings.tensor_parallel_size != 1:
        raise SettingsError(
            "the sglang backend runs one scheduler in the worker's process: "
            "LMPOOL_TENSOR_PARALLEL_SIZE must be 1 (start one worker per GPU, or use vllm)"
        )
    if settings.quantization not in QUANTIZATIONS:
        raise SettingsError(
            f"LMPOOL_QUANTIZATION={settings.quantization} is not supported by the sglang "
            f"backend; it takes {', '.join(QUANTIZATIONS)}"
        )
    options: dict[str, Any] = {
        "dtype": settings.dtype,
        "mem_fraction_static": settings.gpu_memory_utilization,
        "disable_radix_cache": not settings.prefix_caching,
        "disable_cuda_graph": settings.enforce_eager == "true",
    }
    if settings.max_model_len:
        options["context_length"] = settings.max_model_len
    if QUANTIZATIONS[settings.quantization]:
        options["quantization"] = QUANTIZATIONS[settings.quantization]
    return options | settings.engine_kwargs()


def load_engine(path: Path, settings: Settings) -> Any:
    """genlm-backend's SGLang wrapper around a scheduler for ``path``."""
    try:
        import sglang  # noqa: F401
        from genlm.backend.llm.sgl import AsyncSGLTransformer
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    gpu_id = int(settings.device.split(":", 1)[1]) if settings.device.startswith("cuda:") else 0
    return AsyncSGLTransformer.from_name(
        str(path), engine_opts=engine_options(settings), gpu_id=gpu_id
    )


class SGLangBackend(Backend):
    name = "sglang"

    def __init__(
        self, settings: Settings, engine_factory: Callable[[Path, Settings], Any] = load_engine
    ) -> None:
        super().__init__()
        if settings.lora_adapters():
            raise SettingsError("LMPOOL_LORA is not supported by the sglang backend yet")
        if settings.device == "cpu":
            raise SettingsError("the sglang backend runs on CUDA only; use hf or vllm on CPU")
        engine_options(settings)  # settings it cannot serve fail before the engine loads
        source, path = model_dir(settings)
        self.engine = engine_factory(path, settings)
        self.tokenizer = self.engine.tokenizer
        probe = self.engine.batch_next_token_logprobs_sync([[self._probe_token()]])
        config = _engine_attr(self.engine, "model.model_config.hf_config", _OLD_CONFIG)
        context = _engine_attr(self.engine, "model.model_config.context_len")
        self.info = describe_model(
            model_setting=settings.model,
            source=source,
            tokenizer=self.tokenizer,
            dtype=probe.dtype,
            vocab_size=int(probe.shape[-1]),
            max_length=int(context or getattr(config, "max_position_embeddings", 0) or 1 << 15),
            eos_token_ids=eos_token_ids(path, config, self.tokenizer),
            device=settings.device if settings.device != "auto" else "cuda",
            adapters=[],
            variant=quantized(settings.quantization),
        )
        # SGLang's scheduler refuses a prompt of ``max_req_input_len`` tokens or more
        # (``validate_input_length``: ``len(req.origin_input_ids) >= max_req_input_len``; that
        # is its context less 6, or its KV pool's size less 6), and the refusal does not come
        # back as an error: ``set_finish_with_abort`` runs the request as the one token 0, and
        # genlm-backend's driver hands out that row. So the worker refuses such prompts first.
        limit = _engine_attr(self.engine, "model.max_req_input_len")
        own = self.info["max_length"]
        self._input_limit = min(own, int(limit) - 1) if isinstance(limit, int) else own
        log.info(
            "loaded %s with SGLang (vocab %d, prompts up to %d tokens)",
            source,
            self.info["vocab_size"],
            self._input_limit,
        )

    def prompt_limit(self, max_prompt_tokens: int) -> int:
        """The longest prompt SGLang's scheduler reads whole (see ``__init__``), or less when
        the setting says so."""
        return min(max_prompt_tokens or self._input_limit, self._input_limit)

    def _probe_token(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else 0)

    def logprobs(self, prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        self._count(prompts)
        rows = self.engine.batch_next_token_logprobs_sync(prompts)
        return torch.as_tensor(rows).float().cpu()

    def score(
        self, prompt: list[int], continuation: list[int], lora: str | None, greedy: bool = False
    ) -> torch.Tensor:
        prefixes = [prompt + continuation[:i] for i in range(len(continuation))]
        rows = self.logprobs(prefixes, lora)
        if greedy:
            return with_greedy(rows, continuation)
        return rows.gather(1, torch.tensor(continuation)[:, None])[:, 0]

    def close(self) -> None:
        cleanup = getattr(self.engine, "_cleanup_engine", None)
        if callable(cleanup):
            cleanup()
        self.engine = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_OLD_CONFIG = "model.tp_worker.model_config.hf_config"  # the other place SGLangs kept it


def _engine_attr(engine: Any, *paths: str) -> Any:
    """The first of ``paths`` (dotted attributes of the engine) that is there, else None:
    where this SGLang version keeps what the backend reads of its scheduler."""
    for path in paths:
        obj = engine
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    return None
