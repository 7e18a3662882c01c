"""transformers backend: batched, left-padded forward passes; the LM head on the last position only.

genlm-backend computes the LM head and a log-softmax row for every prompt position; a
next-token request needs only the last one, which saves a vocabulary-sized matmul per token.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, cast

import torch

from shared.errors import InvalidRequest, SettingsError
from shared.settings import Settings
from worker.backends.base import Backend, describe_model
from worker.backends.hf import attention
from worker.backends.hf.kv_cache import KVCache
from worker.backends.hf.kv_slots import UnsupportedModel
from worker.backends.model_files import eos_token_ids, model_dir, quantized
from worker.backends.rows import with_greedy

log = logging.getLogger("lmpool.worker")


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def pick_dtype(setting: str, device: torch.device, model_dtype: Any) -> torch.dtype:
    """float32 on CPU; the checkpoint's own dtype on GPU, unless set."""
    if setting != "auto":
        # one of shared.settings.DTYPES, checked at start-up
        return cast(torch.dtype, getattr(torch, setting))
    if device.type == "cpu":
        return torch.float32
    return model_dtype if isinstance(model_dtype, torch.dtype) else torch.bfloat16


class HFBackend(Backend):
    name = "hf"

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        source, path = model_dir(settings)
        config = AutoConfig.from_pretrained(path)
        self.device = pick_device(settings.device)
        if self.device.type == "cuda":
            # cuDNN's attention builds a plan per new shape on first use (seconds on an H100),
            # and KV-cache batches have new shapes all the time; flash attention does not.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.dtype = pick_dtype(settings.dtype, self.device, getattr(config, "dtype", None))
        model_kwargs: dict[str, Any] = {"dtype": self.dtype}
        model_kwargs.update(quantization_kwargs(settings.quantization, self.device, self.dtype))
        self.model: Any = cast(Any, AutoModelForCausalLM).from_pretrained(path, **model_kwargs)
        if "quantization_config" not in model_kwargs:
            self.model.to(self.device)
        self.model.eval()
        if self.device.type == "cpu":
            attention.use_on(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.adapters = load_adapters(self, settings.lora_adapters())
        eos_ids = eos_token_ids(path, config, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id or (eos_ids[0] if eos_ids else 0)
        vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.info = describe_model(
            model_setting=settings.model,
            source=source,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            vocab_size=vocab_size,
            max_length=int(getattr(config, "max_position_embeddings", 2048) or 2048),
            eos_token_ids=eos_ids,
            device=str(self.device),
            adapters=sorted(self.adapters),
            # quantized weights give other results: other cache entries
            variant=quantized(settings.quantization),
        )
        log.info("loaded %s on %s (%s, vocab %d)", source, self.device, self.dtype, vocab_size)
        self.score_positions = max(1, (settings.max_logits_mb << 20) // (4 * vocab_size))
        """Most continuation positions whose logits one score pass holds (``score_passes``)."""
        self.kv_cache: KVCache | None = None
        if settings.kv_cache_mb > 0:
            try:
                self.kv_cache = KVCache(self.model, settings.kv_cache_mb << 20, self.pad_id)
            except UnsupportedModel as e:
                log.warning("kv cache off for %s: %s", source, e)

    def _forward(self, prompts: list[list[int]], lora: str | None, keep: int = 1) -> torch.Tensor:
        """Logits of the last ``keep`` positions of each left-padded prompt, ``[N, keep, V]``."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        self._select_adapter(lora)
        inputs: dict[str, torch.Tensor] = {"input_ids": ids.to(self.device)}
        if any(len(p) != width for p in prompts):
            # Without padding, no mask: the unmasked attention path is bit-identical to a
            # forward of each prompt alone, which a mask (even all ones) is not.
            inputs["attention_mask"] = mask.to(self.device)
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0).to(self.device)
        with torch.inference_mode():
            out = self.model(**inputs, use_cache=False, logits_to_keep=keep)
        return cast(torch.Tensor, out.logits)

    def _select_adapter(self, lora: str | None) -> None:
        if not self.adapters:
            return
        if lora is None:
            self.model.base_model.disable_adapter_layers()
        else:
            self.model.base_model.enable_adapter_layers()
            self.model.set_adapter(lora)

    def logprobs(self, prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        """With ``kv_cache_mb > 0`` only tokens past each prompt's cached prefix run (one trie
        per adapter); otherwise every prompt runs whole. Rows in the model's dtype."""
        return self.decode_logprobs(prompts, lora).to(self.dtype)

    def decode_logprobs(self, sequences: list[list[int]], lora: str | None) -> torch.Tensor:
        """:meth:`logprobs` in float32, as computed (genlm-backend's rows): generations draw
        from these. Rounded to a 16-bit dtype they would tie distinct tokens (greedy took the
        lower id, not the model's argmax) and move each draw's probabilities."""
        self._count(sequences)
        if self.kv_cache is None:
            logits = self._forward(sequences, lora)[:, -1, :]
        else:
            self._select_adapter(lora)
            logits = self.kv_cache.last_logits(sequences, lora, self.settles_later)
        return torch.log_softmax(logits.float(), dim=-1)

    def unsettled(self) -> bool:
        return self.kv_cache is not None and self.kv_cache.unsettled

    def settle(self) -> None:
        """The KV stores of the last step (see ``settles_later``)."""
        if self.kv_cache is not None:
            self.kv_cache.settle()

    def kv_stats(self) -> dict[str, int]:
        """The kv cache's counters (all zero when it is off)."""
        if self.kv_cache is None:
            return dict.fromkeys(KVCache.STAT_NAMES, 0)
        return self.kv_cache.stats()

    def pin_prefix(self, ids: list[int], lora: str | None = None) -> bool:
        """Compute ``ids`` into the kv cache and keep it from eviction (a ``cache_kv`` hint).

        False when the cache is off or the prefix does not fit in its budget.
        """
        if self.kv_cache is None:
            return False
        self._select_adapter(lora)
        try:
            self.kv_cache.pin(ids, namespace=lora)
        except ValueError as e:
            log.warning("not pinned: %s", e)
            return False
        return True

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter next to the others (peft's ``load_adapter``)."""
        from peft import PeftModel

        if name in self.adapters:
            self.remove_lora(name)
        wrapped = isinstance(self.model, PeftModel)
        try:
            if wrapped:
                self.model.load_adapter(path, adapter_name=name)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name)
        except Exception:
            # peft injects the adapter's layers before it loads their weights: a failed load
            # (another model's shapes) leaves them in the model, active on an unwrapped one
            if wrapped and name in self.model.peft_config:
                self.model.delete_adapter(name)
            elif not wrapped:
                strip_adapter_layers(self.model)
            raise
        self.model.eval()
        self.adapters.add(name)
        self.info["adapters"] = sorted(self.adapters)

    def remove_lora(self, name: str) -> bool:
        if name not in self.adapters:
            return False
        self.adapters.discard(name)
        self.info["adapters"] = sorted(self.adapters)
        if self.adapters:
            self.model.delete_adapter(name)
        else:  # peft keeps at least one adapter: unwrap the base model instead
            self.model = self.model.unload()
        if self.kv_cache is not None:
            self.kv_cache.drop(name)
        return True

    def unpin_prefix(self, ids: list[int], lora: str | None = None) -> bool:
        if self.kv_cache is None:
            return False
        return self.kv_cache.unpin(ids, namespace=lora)

    def score(
        self, prompt: list[int], continuation: list[int], lora: str | None, greedy: bool = False
    ) -> torch.Tensor:
        (out,) = self.score_many([(prompt, continuation)], lora, greedy)
        if isinstance(out, BaseException):
            raise out
        return out

    def score_many(
        self, items: list[tuple[list[int], list[int]]], lora: str | None, greedy: bool = False
    ) -> list[torch.Tensor | BaseException]:
        """Each ``(prompt, continuation)``'s token log-probs (``greedy``: and argmax flags), in
        as few forward passes as ``LMPOOL_MAX_LOGITS_MB`` allows (``score_passes``): a pass's
        rows are a prompt and its continuation (or a piece of it) but the last token, whose last
        positions' logits are kept. With the KV cache, only what follows a row's cached prefix
        runs (the choices of a multiple-choice question share their context, a continuation's
        next piece its earlier ones); without it, rows are left-padded."""
        if any(not p for p, _ in items):
            raise InvalidRequest("score needs a prompt of at least one token")
        self._count([p + c[:-1] for p, c in items if c])
        parts: list[list[torch.Tensor]] = [[] for _ in items]
        for group in score_passes([len(c) for _, c in items], self.score_positions):
            rows = [items[k][0] + items[k][1][: end - 1] for k, _, end in group]
            tails = [end - start for _, start, end in group]
            if self.kv_cache is None:
                logits = self._forward(rows, lora, keep=max(tails))
            else:
                self._select_adapter(lora)
                logits = self.kv_cache.tail_logits(rows, tails, lora, self.settles_later)
            width = logits.shape[1]
            for (k, start, end), row in zip(group, logits, strict=True):
                cont = items[k][1][start:end]
                logp = torch.log_softmax(row[width - len(cont) :].float(), dim=-1)
                if greedy:
                    parts[k].append(with_greedy(logp, cont))
                else:
                    index = torch.tensor(cont, device=logp.device)[:, None]
                    parts[k].append(logp.gather(1, index)[:, 0].cpu())
            del logits
        empty = torch.zeros((0, 2) if greedy else 0)
        return [torch.cat(p) if p else empty for p in parts]

    def close(self) -> None:
        del self.model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def score_passes(lengths: list[int], most: int) -> list[list[tuple[int, int, int]]]:
    """Forward passes for continuations of ``lengths``: each a list of ``(item, start, end)``
    pieces, so that a pass's padded logits (its pieces times the longest) cover at most
    ``most`` positions. Short continuations share passes (by length: little padding); one
    longer than ``most`` runs in pieces of ``most``, in order, a pass each. Empty ones run in
    none."""
    passes: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    for k in sorted((k for k, n in enumerate(lengths) if n), key=lambda k: lengths[k]):
        n = lengths[k]
        if current and (len(current) + 1) * n > most:
            passes.append(current)
            current = []
        if n > most:
            passes += [[(k, s, min(s + most, n))] for s in range(0, n, most)]
        else:
            current.append((k, 0, n))
    if current:
        passes.append(current)
    return passes


def quantization_kwargs(mode: str, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """bitsandbytes loading options for ``LMPOOL_QUANTIZATION`` (genlm's ``bitsandbytes_opts``).

    8-bit is LLM.int8(); 4-bit is NF4 computing in the worker's dtype. Both run on CUDA and,
    with bitsandbytes >= 0.45, on CPU.
    """
    if mode == "none":
        return {}
    if mode not in ("8bit", "4bit"):  # awq, gptq, fp8, bitsandbytes: the engines' schemes
        raise SettingsError(
            f"LMPOOL_QUANTIZATION={mode} is not one the hf backend loads: none, 8bit or 4bit "
            "(bitsandbytes); awq, gptq, fp8 and bitsandbytes are vllm's and sglang's"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"LMPOOL_QUANTIZATION={mode} needs bitsandbytes: pip install lmpool[bnb]")
    from transformers import BitsAndBytesConfig

    if mode == "8bit":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    return {"quantization_config": config, "device_map": str(device)}


def strip_adapter_layers(model: Any) -> None:
    """Put back in ``model`` the modules peft wrapped in adapter layers (as peft's ``unload``
    does, for a model it injected layers into but never wrapped)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    model.__dict__.pop("peft_config", None)  # peft keeps its configs on the model too


def load_adapters(backend: HFBackend, adapters: dict[str, str]) -> set[str]:
    """Load each ``name=path`` LoRA adapter with peft; a request picks one by name."""
    if not adapters:
        return set()
    try:
        from peft import PeftModel
    except ImportError as e:  # pragma: no cover - peft is a declared dependency of LoRA use
        raise ImportError("LoRA adapters need peft: pip install peft") from e
    items = list(adapters.items())
    model: Any = None
    for name, path in items:
        try:
            if model is None:
                model = PeftModel.from_pretrained(backend.model, path, adapter_name=name)
            else:
                model.load_adapter(path, adapter_name=name)
        except (OSError, ValueError) as e:  # no adapter there (peft says which file)
            raise SettingsError(f"LMPOOL_LORA: adapter {name!r} from {path!r}: {e}") from None
    model.eval()
    backend.model = model
    return set(adapters)
