"""The interface every backend implements, and the scheduler most of them share.

Backends are synchronous: the worker drives them from one compute thread, so that Redis I/O
for the next works overlaps the model.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.errors import InvalidRequest, UnknownAdapter
from shared.registry import ModelDescription
from worker.backends.rows import draw

log = logging.getLogger("lmpool.worker")
OFFLINE_SHARE_EVERY = 4
"""Batches in a row that may leave offline works waiting; then theirs goes first (the reader
reads offline work first after as many interactive steps in a row)."""


class EngineDead(RuntimeError):
    """The backend's engine is gone (its process died): the worker must stop and exit non-zero
    so that a supervisor restarts it; its unacknowledged messages are reclaimed by others."""


def describe_model(
    *,
    model_setting: str,
    source: Path,
    tokenizer: Any,
    dtype: torch.dtype,
    vocab_size: int,
    max_length: int,
    eos_token_ids: list[int],
    device: str,
    adapters: list[str],
    variant: str = "",
) -> ModelDescription:
    """The ``ModelDescription`` of a checkpoint loaded from ``source`` (a directory or a GGUF file).

    The fingerprint covers the weights and the compute dtype (and ``variant``, e.g. a
    quantization), not the engine: hf and vLLM results of one model share cache entries.
    """
    from shared.tokenizer import tokenizer_config
    from worker.backends.model_files import files_fingerprint

    dtype_name = str(dtype).replace("torch.", "")
    return ModelDescription(
        name_or_path=str(model_setting or source.stem),
        fingerprint=f"{files_fingerprint(source)}-{dtype_name}{variant}",
        vocab_size=vocab_size,
        max_length=max_length,
        eos_token_ids=eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        dtype=dtype_name,
        device=device,
        tokenizer_json=tokenizer.backend_tokenizer.to_str(),
        tokenizer_config=tokenizer_config(tokenizer),
        adapters=sorted(adapters),
    )


def check_ids(ids: np.ndarray | Sequence[int], vocab_size: int) -> None:
    """Raise ``InvalidRequest`` unless every id is in ``[0, vocab_size)`` (vectorized): the
    worker's edge (``worker.stream.batcher``), and a backend whose engine checks less (vLLM
    0.26 checks only the largest id, so a negative one reached the model on an H100,
    ``bench/results/gpu-tests-h100-vllm.txt``)."""
    try:
        ids = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        raise InvalidRequest("token id out of range") from None
    if ids.size == 0:
        raise InvalidRequest("empty prompt: at least one token id is needed")
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.any():
        bad = int(ids[int(np.argmax(outside))])
        raise InvalidRequest(f"token id {bad} is not an integer in [0, {vocab_size})")


@dataclass(eq=False)
class Work:
    """One distinct request handed to a backend (the worker merges identical ones first).

    A backend sets exactly one of ``result`` and ``error`` before it returns the work from
    :meth:`Backend.step`.
    """

    kind: str
    """``logprobs``, ``sample``, ``score`` or ``cache_kv``."""
    ids: list[int]
    """Prompt token ids, validated by the worker."""
    lora: str | None = None
    """LoRA adapter name, or None for the base model."""
    params: dict[str, Any] = field(default_factory=dict)
    """``sample``: max_tokens, eos, temperature, seed; ``score``: cont, greedy (optional)."""
    high: bool = True
    """Interactive (True) or offline work: interactive work is stepped first."""
    result: torch.Tensor | None = None
    error: BaseException | None = None
    tag: Any = None
    """The caller's handle (the worker's job); backends leave it alone."""
    rank: float = 0.0
    """Order among the queued works of one priority, lowest first (the worker's fair share
    between tenants: ``worker.stream.compute``); equal ranks keep their arrival order."""


@dataclass(eq=False)
class Generation:
    """A ``sample`` work being decoded by the default scheduler, one token per step."""

    work: Work
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)

    @property
    def max_tokens(self) -> int:
        return int(self.work.params["max_tokens"])

    def sequence(self) -> list[int]:
        return self.work.ids + self.tokens


class Backend(ABC):
    """A model the pool can query. Subclasses set ``info`` in ``__init__``.

    The worker drives a backend from one compute thread: :meth:`submit` hands it works,
    :meth:`step` advances them and returns the finished ones. The default scheduler here runs,
    at each step, either one batch of next-token / score / cache_kv works (interactive first) or
    one decode step of every running generation, alternating while both kinds wait: a next-token
    request waits for at most one decode step, and generations that run together decode
    together (sequences join and leave at step boundaries). Engines with a scheduler of their
    own (vLLM) override ``submit`` / ``step`` / ``has_work``.

    Subclasses implement :meth:`logprobs` and :meth:`score` (with ``greedy``: each token's
    log-prob beside whether it is the argmax of its position, see :func:`with_greedy`); they
    may override :meth:`score_many`, :meth:`decode_logprobs`, :meth:`pin_prefix` and
    :meth:`kv_stats`, whose defaults are correct but do less.
    """

    name: str = "base"
    info: ModelDescription
    max_batch: int = 16
    """Most rows one step runs, and most generations decoded together (the worker sets it)."""
    settles_later: bool = False
    """Set by the worker's compute loop, which calls :meth:`settle` once a step's answers are
    written: a step may then leave work that no answer waits for (the hf KV cache's stores)
    until that call, so that its answers leave sooner."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows_computed = 0
        """Prompt rows run through the model: the dedupe tests count these."""
        self.tokens_computed = 0
        self._queued: list[Work] = []
        self._running: list[Generation] = []
        self._decoded_last = False
        self._high_run = 0  # batches in a row that left offline works waiting
        self.stepped: list[Work] = []  # what the last step ran, finished or not: its time's share

    # -- validation shared by every backend ---------------------------------------------
    def check_prompt(
        self, n_tokens: int, lora: str | None, max_prompt_tokens: int, what: str = "prompt"
    ) -> None:
        """Raise ``InvalidRequest`` for a prompt the model cannot take: too long (``n_tokens``:
        all the model reads, ``what`` says of what), or an unknown adapter (the worker has
        already checked each id against the vocabulary)."""
        if n_tokens < 1:
            raise InvalidRequest("empty prompt: at least one token id is needed")
        limit = self.prompt_limit(max_prompt_tokens)
        if n_tokens > limit:
            raise InvalidRequest(f"{what} of {n_tokens} tokens exceeds the limit of {limit}")
        if lora is not None and lora not in self.info["adapters"]:
            known = ", ".join(self.info["adapters"]) or "none"
            raise UnknownAdapter(f"unknown LoRA adapter {lora!r}; loaded: {known}")

    def prompt_limit(self, max_prompt_tokens: int) -> int:
        """Longest prompt accepted: the model's context, or less when the setting says so."""
        return min(max_prompt_tokens or self.info["max_length"], self.info["max_length"])

    def _count(self, prompts: list[list[int]]) -> None:
        with self._lock:
            self.rows_computed += len(prompts)
            self.tokens_computed += sum(map(len, prompts))

    # -- the model ------------------------------------------------------------------------
    @abstractmethod
    def logprobs(self, prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        """Normalized next-token log-probs, ``[len(prompts), vocab_size]``."""

    @abstractmethod
    def score(
        self, prompt: list[int], continuation: list[int], lora: str | None, greedy: bool = False
    ) -> torch.Tensor:
        """Log-prob of each continuation token given all before it, ``[len(continuation)]``;
        with ``greedy``, ``[len(continuation), 2]``: log-prob, and 1.0 where the token is the
        argmax of its position (:func:`with_greedy`)."""

    def score_many(
        self, items: list[tuple[list[int], list[int]]], lora: str | None, greedy: bool = False
    ) -> list[torch.Tensor | BaseException]:
        """:meth:`score` of each ``(prompt, continuation)``; backends batch it when they can.
        An item may come back as an exception instead of a tensor (that item failed)."""
        out: list[torch.Tensor | BaseException] = []
        for prompt, cont in items:
            try:
                out.append(self.score(prompt, cont, lora, greedy))
            except Exception as e:
                out.append(e)
        return out

    def decode_logprobs(self, sequences: list[list[int]], lora: str | None) -> torch.Tensor:
        """Next-token log-probs of running generations (one decode step). The default is
        :meth:`logprobs`; a backend with a KV cache computes only each sequence's new token."""
        return self.logprobs(sequences, lora)

    def pin_prefix(self, ids: list[int], lora: str | None = None) -> bool:
        """Keep this prefix's key/values in the backend's cache (a ``cache_kv`` hint); False
        when the backend has no such cache."""
        return False

    def unpin_prefix(self, ids: list[int], lora: str | None = None) -> bool:
        """Let the cache evict a prefix pinned with :meth:`pin_prefix` again; False when it
        was not pinned here."""
        return False

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter in folder ``path`` and serve it as ``name`` from now on
        (run-time adapters, see ``worker.adapters``)."""
        raise UnknownAdapter(f"the {self.name} backend cannot load LoRA adapters at run time")

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter ``name``; False when it was not served."""
        return False

    def kv_stats(self) -> dict[str, int]:
        """Counters of the backend's KV cache (hits, bytes...); empty when it has none."""
        return {}

    def unsettled(self) -> bool:
        """Whether a step left work for :meth:`settle`."""
        return False

    def settle(self) -> None:
        """Do the work that steps left for later (in the compute thread, between steps)."""

    def close(self) -> None:
        """Free the model and its device memory."""

    # -- the scheduler --------------------------------------------------------------------
    def submit(self, works: Sequence[Work]) -> None:
        """Queue works; they finish in later calls of :meth:`step`."""
        self._queued.extend(works)

    def has_work(self) -> bool:
        return bool(self._queued or self._running)

    def drop_generations(self, gone: Callable[[Work], bool]) -> list[Work]:
        """Forget the ``sample`` works for which ``gone(work)`` holds (their askers gave up);
        returns them unanswered. vLLM's own scheduler keeps its: nothing is returned."""
        dropped = [g.work for g in self._running if gone(g.work)]
        dropped += [w for w in self._queued if w.kind == "sample" and gone(w)]
        if dropped:
            ids = {id(w) for w in dropped}
            self._running = [g for g in self._running if id(g.work) not in ids]
            self._queued = [w for w in self._queued if id(w) not in ids]
        return dropped

    def abandon(self) -> None:
        """Forget every queued and running work: a step failed as a whole, and the worker
        answered them all with its error."""
        self._queued.clear()
        self._running.clear()

    def step(self) -> list[Work]:
        """Advance the queued and running works by one model call; returns those finished."""
        self.stepped = []
        if not self.has_work():
            return []
        waiting = [w for w in self._queued if w.kind != "sample"]
        room = len(self._running) < self.max_batch and any(w.kind == "sample" for w in self._queued)
        if waiting and (not self._running or self._decoded_last):
            self._decoded_last = False
            return self._run_batch(waiting)
        if room:
            self._admit()
        if self._running:
            self._decoded_last = True
            self.stepped = [g.work for g in self._running]
            return self._decode_step()
        self._decoded_last = False
        return self._run_batch(waiting)

    def _take(self, works: list[Work]) -> list[Work]:
        """The next batch: interactive works first, at most ``max_batch`` rows, one kind and
        adapter (by rank, then arrival order, within each); offline works first after
        ``OFFLINE_SHARE_EVERY`` batches in a row that left them waiting."""
        low_turn = self._high_run >= OFFLINE_SHARE_EVERY
        ordered = sorted(works, key=lambda w: (w.high == low_turn, w.rank))  # stable
        first = ordered[0]
        batch = [w for w in ordered if w.kind == first.kind and w.lora == first.lora]
        batch = batch[: self.max_batch]
        left = first.high and any(not w.high and w not in batch for w in works)
        self._high_run = self._high_run + 1 if left else 0
        taken = {id(w) for w in batch}
        self._queued = [w for w in self._queued if id(w) not in taken]
        return batch

    def _run_batch(self, waiting: list[Work]) -> list[Work]:
        batch = self.stepped = self._take(waiting)
        self._compute(batch)
        return batch

    def _compute(self, batch: list[Work]) -> None:
        """Results (or errors) for one batch of a single kind and adapter."""
        kind, lora = batch[0].kind, batch[0].lora
        try:
            if kind == "logprobs":
                rows = self.logprobs([w.ids for w in batch], lora)
                for w, row in zip(batch, rows, strict=True):
                    w.result = row
            elif kind == "score":
                # one pass for the batch; works that did not ask for the greedy column drop it
                greedy = any(w.params.get("greedy") for w in batch)
                items = [(w.ids, w.params["cont"]) for w in batch]
                outs = self.score_many(items, lora, greedy)
                for w, out in zip(batch, outs, strict=True):
                    if isinstance(out, BaseException):
                        w.error = out
                    elif greedy and not w.params.get("greedy"):
                        w.result = out[:, 0].float().contiguous()
                    else:
                        w.result = out.float()
            elif kind == "cache_kv":
                for w in batch:
                    if w.params.get("pin", True):
                        done = self.pin_prefix(w.ids, lora)
                    else:
                        done = self.unpin_prefix(w.ids, lora)
                    w.result = torch.tensor([int(bool(done))], dtype=torch.int64)
            else:
                raise InvalidRequest(f"unknown request kind {kind!r}")
        except Exception as e:
            if len(batch) > 1:
                # one bad row must not fail its batch mates
                log.warning("batch of %d failed; retrying one by one", len(batch), exc_info=True)
                for w in batch:
                    self._compute([w])
                return
            batch[0].error = e

    def _admit(self) -> None:
        """Start queued generations while fewer than ``max_batch`` run (interactive first)."""
        samples = sorted((w for w in self._queued if w.kind == "sample"), key=lambda w: not w.high)
        admitted: list[Work] = []
        for work in samples:
            if len(self._running) >= self.max_batch:
                break
            seed = work.params.get("seed")
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
            self._running.append(Generation(work, generator))
            admitted.append(work)
        taken = {id(w) for w in admitted}
        self._queued = [w for w in self._queued if id(w) not in taken]

    def _decode_step(self) -> list[Work]:
        """One token for every running generation (one model call per adapter)."""
        finished: list[Work] = []
        for gen in [g for g in self._running if g.max_tokens <= 0]:
            gen.work.result = torch.tensor([], dtype=torch.int64)
            finished.append(gen.work)
        by_lora: dict[str | None, list[Generation]] = {}
        for gen in self._running:
            if gen.max_tokens > 0:
                by_lora.setdefault(gen.work.lora, []).append(gen)
        for lora, gens in by_lora.items():
            try:
                rows = self.decode_logprobs([g.sequence() for g in gens], lora)
            except Exception as e:
                for g in gens:
                    g.work.error = e
                    finished.append(g.work)
                continue
            for gen, row in zip(gens, rows, strict=True):
                p = gen.work.params
                try:
                    token = draw(row, float(p["temperature"]), gen.generator)
                except Exception as e:  # this generation's own: its batch mates go on
                    gen.work.error = e
                    finished.append(gen.work)
                    continue
                if token in p["eos"]:
                    done = True
                else:
                    gen.tokens.append(token)
                    done = len(gen.tokens) >= gen.max_tokens
                if done:
                    gen.work.result = torch.tensor(gen.tokens, dtype=torch.int64)
                    finished.append(gen.work)
        ended = {id(w) for w in finished}
        self._running = [g for g in self._running if id(g.work) not in ended]
        return finished

    # -- one request at a time (tests, tools) ---------------------------------------------
    def run(self, works: Sequence[Work]) -> list[Work]:
        """Submit ``works`` and step until all of them have finished (nothing else may be
        running on this backend meanwhile)."""
        self.submit(works)
        waiting = {id(w) for w in works}
        while waiting:
            if not self.has_work():
                raise RuntimeError("backend stopped before finishing its works")
            for w in self.step():
                waiting.discard(id(w))
        for w in works:
            if w.error is not None:
                raise w.error
        return list(works)

    def sample(
        self,
        prompt: list[int],
        max_tokens: int,
        eos_token_ids: list[int],
        temperature: float,
        seed: int | None,
        lora: str | None,
    ) -> list[int]:
        """A generation with genlm-backend's semantics (EOS not appended), through the
        scheduler: each token is drawn from ``softmax(logprobs / temperature)`` with a CPU
        generator seeded by ``seed``, so a seed gives the same tokens alone or in a batch."""
        params = {
            "max_tokens": max_tokens,
            "eos": list(eos_token_ids),
            "temperature": temperature,
            "seed": seed,
        }
        (work,) = self.run([Work("sample", prompt, lora, params)])
        assert work.result is not None
        return [int(t) for t in work.result.tolist()]
