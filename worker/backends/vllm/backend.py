"""vLLM backend: vLLM's engine with its own scheduler, stepped by the worker's compute thread.

:meth:`VLLMBackend.submit` turns each work into one engine request right away
(``LLMEngine.add_request``; interactive works at priority 0, offline at 1, under vLLM's
``priority`` scheduling policy), so the engine core starts on it while the worker does other
things. :meth:`VLLMBackend.step` is one ``LLMEngine.step()``: the outputs of the engine's next
step, from which it returns the works that finished. vLLM batches continuously: generations
decode together, and a next-token request joins the running batch at the next engine step
instead of waiting for generations to end.

The parts: the engine started with the row capture and watched (:mod:`.engine`), each kind of
work as a vLLM request and back (:mod:`.works`), ``logprobs`` rows fetched from the process that
runs the model (:mod:`.rows`, written there by :mod:`.capture`). When the engine core process
dies, :meth:`VLLMBackend.step` raises ``EngineDead`` (the watchdog unblocks a step or a row
fetch that waits for it).
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shared.errors import InvalidRequest, SettingsError, UnknownAdapter
from shared.settings import Settings
from worker.backends.base import Backend, EngineDead, Work, check_ids, describe_model
from worker.backends.model_files import eos_token_ids, model_dir, quantized
from worker.backends.vllm.engine import (
    EngineWatch,
    check_capture,
    engine_processes,
    import_vllm,
    start_engine,
)
from worker.backends.vllm.lora import adapter_config, check_lora_targets
from worker.backends.vllm.rows import RowCounter, RowFetcher
from worker.backends.vllm.works import (
    KINDS,
    client_error,
    output_result,
    prompt_ids,
    sampling_params,
    score_result,
)

log = logging.getLogger("lmpool.worker")


class VLLMBackend(Backend):
    name = "vllm"
    transfer_s = RowCounter()
    """Time the compute thread spent fetching or waiting for captured rows."""
    transfers = RowCounter()
    transferred_rows = RowCounter()
    prefetches = RowCounter()

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        started = time.monotonic()
        import_vllm()
        from transformers import AutoConfig, AutoTokenizer
        from vllm.lora.request import LoRARequest

        from worker.backends.vllm import capture

        self._capture = capture
        self._LoRARequest = LoRARequest
        self._engine_lock = threading.RLock()
        self.watch = EngineWatch(lambda: self.engine)
        self.rows = RowFetcher(capture, self.watch)
        self._inflight: dict[str, Work] = {}
        self._held: list[Work] = []
        """Works waiting for the engine to hold only their adapter (see ``_may_join``)."""
        self._ready: list[Work] = []
        self._ids = itertools.count()
        self._prefix = f"lmpool-{uuid.uuid4().hex[:8]}-"
        self.engine: Any = None

        source, path = model_dir(settings)
        adapters = settings.lora_adapters()
        self.engine, kwargs, device_type = start_engine(settings, path, adapters, capture)
        self.prefix_caching = bool(kwargs.get("enable_prefix_caching"))
        try:
            check_capture(self.engine, capture)
        except RuntimeError:
            self.close()
            raise
        self._lora_ids = itertools.count(1)
        self._lora_requests = {
            name: self._new_lora_request(name, Path(p).expanduser()) for name, p in adapters.items()
        }
        model_cfg = self.engine.model_config
        scheduler = getattr(getattr(self.engine, "vllm_config", None), "scheduler_config", None)
        self.rows.chunked = getattr(scheduler, "enable_chunked_prefill", True) is not False
        self.dtype: torch.dtype = model_cfg.dtype
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        eos_ids = eos_token_ids(path, AutoConfig.from_pretrained(path), self.tokenizer)
        vocab_size = int(model_cfg.get_vocab_size())
        self.info = describe_model(
            model_setting=settings.model,
            source=source,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            vocab_size=vocab_size,
            max_length=int(model_cfg.max_model_len),
            eos_token_ids=eos_ids,
            device=device_type,
            adapters=sorted(self._lora_requests),
            variant=quantized(settings.quantization),
        )
        processes = self.engine_processes()
        self.watch.start(processes)
        self._warm_up()
        self.startup_s = time.monotonic() - started
        log.info(
            "loaded %s with vLLM on %s in %.1f s (%s, vocab %d, adapters %s, engine core %s)",
            source,
            device_type,
            self.startup_s,
            self.info["dtype"],
            vocab_size,
            self.info["adapters"] or "none",
            ", ".join(f"pid {p.pid}" for p in processes) or "in this process",
        )

    def _warm_up(self) -> None:
        """One row per adapter: loads the adapters now and proves the capture works."""
        probe = [self.info["bos_token_id"] or 0]
        for lora in [None, *self._lora_requests]:
            row = self.logprobs([probe], lora)
            if row.shape != (1, self.info["vocab_size"]):
                raise RuntimeError(
                    f"captured logits have shape {tuple(row.shape)}, expected "
                    f"(1, {self.info['vocab_size']})"
                )
        self.rows_computed = self.tokens_computed = 0
        self.transfer_s, self.transfers, self.transferred_rows = 0.0, 0, 0

    def prompt_limit(self, max_prompt_tokens: int) -> int:
        """vLLM holds a prompt and at least one token to generate in the model's context: a
        row after ``max_length - 1`` tokens at most (a score reads as many, see ``works``)."""
        own = self.info["max_length"] - 1
        return min(max_prompt_tokens or own, own)

    def engine_processes(self) -> list[Any]:
        """vLLM's engine core processes; empty when the engine core runs in this process."""
        return engine_processes(self.engine)

    # -- the scheduler ----------------------------------------------------------------------
    def submit(self, works: Sequence[Work]) -> None:
        with self._engine_lock:
            for work in works:
                if self._may_join(work):
                    self._enter(work)
                else:
                    self._held.append(work)

    def _may_join(self, work: Work) -> bool:
        """Whether ``work`` may enter the engine now. vLLM computes a score's prompt log-probs
        with a per-request adapter mapping that, on the CPU, applied another request's adapter
        now and then when requests of several adapters shared a step (one run in three of
        ``test_scores_share_steps_with_adapters_and_generations``). So a score enters only
        when every work in the engine has its adapter, and no work of another adapter enters
        while a score is in the engine or waits for it."""
        if self.watch.dead is not None or self.engine is None:
            return True  # answered by _enter as the dead engine's
        inside = list(self._inflight.values())
        if work.kind == "score":
            return all(w.lora == work.lora for w in inside)
        scores = [w for w in [*inside, *self._held] if w.kind == "score"]
        return all(w.lora == work.lora for w in scores)

    def _enter(self, work: Work) -> None:
        if self.watch.dead is not None or self.engine is None:
            # left unanswered: step() raises EngineDead and the entries are reclaimed
            self._inflight[f"dead-{next(self._ids)}"] = work
            return
        try:
            self._add(work)
        except EngineDead:
            self._inflight[f"dead-{next(self._ids)}"] = work
        except Exception as e:
            if self.watch.is_dead():
                self._inflight[f"dead-{next(self._ids)}"] = work
                return
            if client_error(e):
                e = InvalidRequest(f"vLLM refused the request: {e}")  # e.g. too long
            work.error = e
            self._ready.append(work)

    def _release_held(self) -> None:
        """Let in the held works that may join now (in arrival order)."""
        held, self._held = self._held, []
        for work in held:
            if self._may_join(work):
                self._enter(work)
            else:
                self._held.append(work)

    def has_work(self) -> bool:
        return bool(self._inflight or self._ready or self._held)

    def step(self) -> list[Work]:
        """The works finished at the engine's next step (blocks until the engine core sends
        that step's outputs); raises ``EngineDead`` when the engine core is gone."""
        with self._engine_lock:
            if self.watch.dead is not None:
                raise EngineDead(self.watch.dead)
            self._release_held()
            if self._ready or not self._inflight:
                done, self._ready = self._ready, []
                self.stepped = done
                return done
            self.stepped = list(self._inflight.values())  # every request in the engine's step
            self._prefetch_rows()
            try:
                outputs = self.engine.step()
            except EngineDead:
                raise self.watch.gone() from None
            except Exception as e:
                raise self.watch.gone(e) from e
            done = self._finish(outputs)
            self._prefetch_rows()
            return done

    def _add(self, work: Work) -> None:
        if work.kind not in KINDS:
            raise InvalidRequest(f"unknown request kind {work.kind!r}")
        if not work.ids:
            raise InvalidRequest("empty prompt: at least one token id is needed")
        ids = prompt_ids(work)
        check_ids(ids, self.info["vocab_size"])
        steps = int(work.params["max_tokens"]) if work.kind == "sample" else 1
        if len(ids) + steps > self.info["max_length"]:  # vLLM would stop short, or refuse
            raise InvalidRequest(
                f"{len(ids)} prompt tokens and {steps} to generate exceed the model's context "
                f"of {self.info['max_length']} tokens (vLLM holds both in it)"
            )
        lora_request = self._lora_request(work.lora)
        rid = f"{self._prefix}{next(self._ids)}"
        params = sampling_params(work, rid, self._capture.CAPTURE_KEY, self.prefix_caching)
        if params is None:  # answered without the engine
            self._ready.append(work)
            return
        self.engine.add_request(
            rid,
            {"prompt_token_ids": ids},
            params,
            lora_request=lora_request,
            priority=0 if work.high else 1,
        )
        self._inflight[rid] = work
        if work.kind in ("logprobs", "sample", "score"):
            self._count([ids])

    def _new_lora_request(self, name: str, folder: Path) -> Any:
        """vLLM's request for one load of adapter ``name``: a fresh id, and a name of its own
        (``name#id``). vLLM's prefix cache keys an adapter's blocks on its name (0.26: the name
        alone; 0.32: name and path), so a name served again with other weights would read
        the KV blocks computed with the old ones."""
        lora_id = next(self._lora_ids)
        return self._LoRARequest(f"{name}#{lora_id}", lora_id, str(folder))

    def _lora_request(self, lora: str | None) -> Any:
        if lora is None:
            return None
        request = self._lora_requests.get(lora)
        if request is None:
            known = ", ".join(sorted(self._lora_requests)) or "none"
            raise UnknownAdapter(f"unknown LoRA adapter {lora!r}; loaded: {known}")
        return request

    def _finish(self, outputs: list[Any]) -> list[Work]:
        done: list[Work] = []
        captured: list[tuple[str, Work]] = []
        for out in outputs:
            if not getattr(out, "finished", False):
                continue
            work = self._inflight.pop(out.request_id, None)
            if work is None:
                continue
            try:
                result = output_result(work, out, self.prefix_caching)
            except Exception as e:
                work.error = e
            else:
                work.result = result
                if work.kind in ("logprobs", "score"):  # a row was captured too
                    captured.append((out.request_id, work))
                    continue
            done.append(work)
        if captured:
            rows = self.rows.take(self.engine, [rid for rid, _ in captured], self._inflight)
            for rid, work in captured:
                row = rows.get(rid)
                if row is None:
                    work.error = RuntimeError("vLLM ran the request but no logits were captured")
                elif work.kind == "score":
                    assert work.result is not None
                    work.result = score_result(work, work.result, row)
                else:
                    work.result = row.to(self.dtype)
                done.append(work)
        return done

    def _prefetch_rows(self) -> None:
        """Ask for the rows captured so far while ``logprobs`` works are in the engine
        (:meth:`RowFetcher.prefetch`)."""
        wanted = any(w.kind in ("logprobs", "score") for w in self._inflight.values())
        self.rows.prefetch(self.engine, wanted)

    # -- one call at a time (tests, tools) ----------------------------------------------------
    def logprobs(self, prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        where: dict[tuple[int, ...], int] = {}
        slots = [where.setdefault(tuple(p), len(where)) for p in prompts]
        works = [Work("logprobs", list(p), lora) for p in where]
        self.run(works)
        block = torch.stack([w.result for w in works])  # type: ignore[misc]
        if len(works) < len(prompts):
            block = block[torch.tensor(slots)]
        return block

    def score(
        self, prompt: list[int], continuation: list[int], lora: str | None, greedy: bool = False
    ) -> torch.Tensor:
        if not prompt:
            raise InvalidRequest("score needs a prompt of at least one token")
        (work,) = self.run([Work("score", list(prompt), lora, score_params(continuation, greedy))])
        assert work.result is not None
        return work.result

    def score_many(
        self, items: list[tuple[list[int], list[int]]], lora: str | None, greedy: bool = False
    ) -> list[Any]:
        works = [Work("score", list(p), lora, score_params(c, greedy)) for p, c in items]
        self.submit(works)
        waiting = {id(w) for w in works}
        while waiting:
            for w in self.step():
                waiting.discard(id(w))
        return [w.error if w.error is not None else w.result for w in works]

    def pin_prefix(self, ids: list[int], lora: str | None = None) -> bool:
        (work,) = self.run([Work("cache_kv", list(ids), lora)])
        return bool(work.result is not None and int(work.result[0]))

    # -- adapters at run time -----------------------------------------------------------------
    def add_lora(self, name: str, path: str | Path) -> None:
        """Serve LoRA adapter ``name`` from ``path`` (a PEFT directory) from now on; vLLM loads
        it at its first request. Replacing a name takes a fresh adapter id and vLLM name, so the
        new weights are loaded and no KV block of the old ones is reused (even from the same
        folder, rewritten). The engine must have been started with LoRA enabled."""
        lora_config = getattr(self.engine.vllm_config, "lora_config", None)
        if lora_config is None:
            raise SettingsError(
                "this vllm worker started without LoRA support: set LMPOOL_LORA, or "
                'LMPOOL_ENGINE_OPTIONS={"enable_lora": true, "max_lora_rank": 64}'
            )
        folder = Path(path).expanduser()
        config = adapter_config(name, str(folder), "add_lora")
        try:
            check_lora_targets(name, config, "add_lora")
        except SettingsError as e:
            raise InvalidRequest(str(e)) from None
        rank = int(config["r"])
        if rank > int(lora_config.max_lora_rank):
            raise InvalidRequest(
                f"LoRA adapter {name} has rank {rank}; this worker's engine takes at most "
                f"{lora_config.max_lora_rank} (max_lora_rank)"
            )
        with self._engine_lock:
            old = self._lora_requests.get(name)
            self._lora_requests[name] = self._new_lora_request(name, folder)
            self.info["adapters"] = sorted(self._lora_requests)
            if old is not None:
                self._forget_lora(name, old)

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter ``name``; False when it was not served. Requests already in
        the engine finish with it."""
        with self._engine_lock:
            old = self._lora_requests.pop(name, None)
            self.info["adapters"] = sorted(self._lora_requests)
            if old is None:
                return False
            self._forget_lora(name, old)
            return True

    def _forget_lora(self, name: str, request: Any) -> None:
        if any(w.lora == name for w in self._inflight.values()):
            return  # still in use; vLLM evicts it when it needs the slot
        try:
            self.engine.remove_lora(request.lora_int_id)
        except Exception:
            log.debug("vLLM had not loaded adapter %s", request.lora_name, exc_info=True)

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        self.watch.closing.set()
        engine, self.engine = self.engine, None
        if engine is None:
            return
        if self.watch.dead is None:
            self.watch.dead = "the vllm backend is closed"
        try:
            engine.engine_core.shutdown()
        except Exception:  # pragma: no cover - best effort at teardown
            log.warning("vLLM engine shutdown failed", exc_info=True)
        del engine
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


def score_params(continuation: list[int], greedy: bool) -> dict[str, Any]:
    """A score work's parameters, as the worker's request carries them."""
    params: dict[str, Any] = {"cont": list(continuation)}
    if greedy:
        params["greedy"] = True
    return params
