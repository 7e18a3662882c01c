"""lm-evaluation-harness on the pool: the model ``lmpool``.

``lm_eval --model lmpool --model_args redis_url=redis://host:6379/0,model=NAME --tasks ...``
and ``lm_eval.simple_evaluate(model="lmpool", model_args=...)`` evaluate a model served by the
pool: this host needs lm-eval and the pool's address, no model files (the tokenizer comes from
the workers' metadata). lm-eval 0.4.13 finds models only in its registry, so the installed
package registers ``lmpool`` there when lm-eval loads its models (``lmpool_harness.py``, run by
``lmpool_harness.pth`` at interpreter start-up); importing this module registers it too.

- ``loglikelihood``: context and continuation tokenized as lm-eval's ``hf`` model does them
  (``TemplateLM``: the pair encoded whole, then split), left-truncated to ``max_length + 1``
  tokens as there, each pair one ``score`` request with ``greedy=True`` (``is_greedy``: every
  continuation token the argmax of its position). All requests of a call are in flight at once
  (``concurrency``), ordered so that a question's choices go together: the workers batch them,
  the hf worker's KV cache runs each shared context once, and the shared result cache answers
  any request already scored, by any producer.
- ``loglikelihood_rolling``: lm-eval's own windows (``get_rolling_token_windows``,
  ``make_disjoint_window``), sized by ``max_length``, scored as above and summed.
- ``generate_until``: ``sample`` requests (greedy unless the task samples), decoded and cut at
  the first stop string as lm-eval's ``hf`` does; a generation goes in chunks of 32, 64, 128...
  tokens and stops at the first chunk that holds a stop string, EOS or ``max_gen_toks``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import jinja2
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from producer.harness_args import HarnessArgs, preflight
from producer.remote_lm import RemoteLM
from shared.tokenizer import tokenizer_from_json

log = logging.getLogger("lmpool.harness")
T = TypeVar("T")
Pair = tuple[list[int], list[int]]
FIRST_CHUNK_TOKENS = 32
"""A generation's first request asks for this many tokens, each next one for twice as many."""


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to its end from lm-eval's synchronous methods: in this thread, or in a
    thread of its own where this one already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, make()).result()


@register_model("lmpool")
class LMPoolLM(TemplateLM):
    """An lm-eval ``LM`` whose model runs on the pool's workers. ``model_args``: see
    :class:`producer.harness_args.HarnessArgs` (``redis_url``, ``model``, ``timeout_s``, ...)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.args = HarnessArgs.parse(kwargs)
        preflight(self.args)
        self.lm = RemoteLM.from_name(
            self.args.model, settings=self.args.settings(), priority=self.args.priority
        )
        meta = self.lm.meta
        self.tokenizer = self.lm.tokenizer
        if self.args.add_bos_token is not None:  # as hf's AutoTokenizer(add_bos_token=...)
            self.tokenizer = tokenizer_from_json(
                meta["tokenizer_json"], meta["tokenizer_config"],
                add_bos_token=self.args.add_bos_token,
            )  # fmt: skip
        # A window of max_length tokens plus its last target: the workers read up to
        # prompt_limit tokens of a score (its last token is never read).
        default = self.lm.prompt_limit
        self._max_length = self.args.max_length or default
        if self._max_length > default:
            raise ValueError(
                f"lmpool model_args max_length={self._max_length} exceeds what the pool's "
                f"workers take for model {self.lm.model!r} ({default})"
            )
        self._rank, self._world_size = 0, 1
        self._device = "pool"

    # -- what lm-eval reads -------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos if eos is not None else self.lm.eos_token_ids[0])

    @property
    def prefix_token_id(self) -> int:
        """As lm-eval's ``hf``: the custom one, else BOS, else EOS."""
        if self.args.prefix_token_id is not None:
            return self.args.prefix_token_id
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self.args.max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path or self.lm.model).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        meta = self.lm.meta
        return {
            "lmpool_model": self.lm.model,
            "model_fingerprint": self.lm.fingerprint,
            "model_dtype": meta.get("dtype"),
            "backend": meta.get("backend"),
        }

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """As ``HFLM``'s: a template that refuses the system role gets the history without it."""

        def apply(history: list[dict[str, str]]) -> str:
            return str(
                self.tokenizer.apply_chat_template(
                    history,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                )
            )

        try:
            return apply(chat_history)
        except jinja2.exceptions.TemplateError:
            log.warning("the chat template failed: trying again without the system role")
            return apply([m for m in chat_history if m["role"] != "system"])

    # -- tokens, as lm-eval's hf model makes them --------------------------------------------
    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """``HFLM.tok_encode``: the tokenizer's own special tokens unless told (or unless the
        string starts with the prefix token's text); left-truncated when asked."""
        special = self.args.add_bos_token if add_special_tokens is None else add_special_tokens
        options = {} if special is None else {"add_special_tokens": special}
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            options["add_special_tokens"] = False
        ids = [int(t) for t in self.tokenizer.encode(string, **options)]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens))

    # -- log-likelihoods ------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """``(sum of log-probs, is_greedy)`` of each ``(strings, context, continuation)``."""
        pairs = [self._truncate(ctx, cont) for _, ctx, cont in requests]
        results = run_sync(lambda: self._score_all(pairs, disable_tqdm))
        for (strings, _, _), answer in zip(requests, results, strict=True):
            if strings is not None:  # rolling windows are cached per document
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return results

    def _truncate(self, context: list[int], continuation: list[int]) -> Pair:
        """``HFLM``'s left truncation: the last ``max_length + 1`` tokens of the pair."""
        if not continuation or len(continuation) > self.max_length:
            raise ValueError(
                f"a continuation of {len(continuation)} tokens: lm-eval needs 1 to "
                f"max_length={self.max_length}"
            )
        whole = (context + continuation)[-(self.max_length + 1) :]
        return whole[: len(whole) - len(continuation)], continuation

    async def _score_all(self, pairs: list[Pair], disable_tqdm: bool) -> list[tuple[float, bool]]:
        # a question's choices side by side (longest context first): they meet in one batch
        order = sorted(range(len(pairs)), key=lambda i: (-len(pairs[i][0]), pairs[i][0]))

        async def one(i: int) -> tuple[float, bool]:
            context, continuation = pairs[i]
            out = await self.lm.score(context, continuation, self.args.lora, greedy=True)
            return float(out[:, 0].double().sum()), bool(out[:, 1].all())

        calls: list[Callable[[], Awaitable[tuple[float, bool]]]] = [
            functools.partial(one, i) for i in order
        ]
        return await self._in_flight(calls, order, disable_tqdm, "loglikelihood")

    async def _in_flight(
        self,
        calls: list[Callable[[], Awaitable[T]]],
        order: list[int],
        disable_tqdm: bool,
        what: str,
    ) -> list[T]:
        """Run ``calls`` with at most ``concurrency`` in flight, a progress bar as lm-eval's
        models show; result ``k`` of ``calls`` goes to position ``order[k]``."""
        results: list[Any] = [None] * len(calls)
        gate = asyncio.Semaphore(self.args.concurrency)
        bar = tqdm(total=len(calls), disable=disable_tqdm, desc=f"Running {what} requests")

        async def run(k: int) -> None:
            async with gate:
                results[order[k]] = await calls[k]()
            bar.update(1)

        try:
            await asyncio.gather(*(run(k) for k in range(len(calls))))
        finally:
            bar.close()
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over lm-eval's own disjoint windows."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (string,) in [req.args for req in requests]:
            found = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows.extend((None, ctx, cont) for ctx, cont in found)
            counts.append(len(found))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, at = [], 0
        for req, n in zip(requests, counts, strict=True):
            total = sum(logprob for logprob, _ in scores[at : at + n])
            at += n
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # -- generation -----------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        outputs = run_sync(lambda: self._generate_all(args, disable_tqdm))
        for (context, gen_kwargs), text in zip(args, outputs, strict=True):
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return outputs

    async def _generate_all(self, args: list[tuple[str, dict[str, Any]]], quiet: bool) -> list[str]:
        calls: list[Callable[[], Awaitable[str]]] = [
            functools.partial(self._generate, c, g) for c, g in args
        ]
        return await self._in_flight(calls, list(range(len(args))), quiet, "generate_until")

    async def _generate(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        sampling = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0))
        temperature = temperature if sampling else 0.0
        if kwargs:
            log.warning("lmpool ignores these generation arguments: %s", sorted(kwargs))
        if max_gen_toks >= self.max_length:
            raise ValueError(f"max_gen_toks={max_gen_toks} must be below {self.max_length}")
        prompt = self._generation_prompt(context, self.max_length - max_gen_toks)
        seed = int.from_bytes(hashlib.blake2b(context.encode(), digest_size=6).digest(), "big")
        tokens: list[int] = []
        chunk = FIRST_CHUNK_TOKENS
        while len(tokens) < max_gen_toks:
            ask = min(chunk, max_gen_toks - len(tokens))
            new = await self.lm.sample(
                prompt + tokens,
                ask,
                self.lm.eos_token_ids,
                temperature=temperature,
                seed=(self.args.seed + seed + len(tokens)) % (1 << 62),
                lora_name=self.args.lora,
            )
            tokens.extend(new)
            text = self.tok_decode(tokens)
            if len(new) < ask or any(stop and stop in text for stop in until):
                break  # ended by EOS, or a stop string is there
            chunk *= 2
        return str(postprocess_generated_text(self.tok_decode(tokens), until, None))

    def _generation_prompt(self, context: str, keep: int) -> list[int]:
        """``HFLM``'s encoding of a generation's context, its last ``keep`` tokens."""
        bos = getattr(self.tokenizer, "bos_token", None)
        special = self.args.add_bos_token
        if has_bos_prefix(context, bos):
            special = False
        options = {} if special is None else {"add_special_tokens": special}
        ids = [int(t) for t in self.tokenizer.encode(context, **options)]
        return ids[-keep:]

    def __del__(self) -> None:
        lm = getattr(self, "lm", None)
        if lm is not None:
            try:
                lm.cleanup()
            except Exception:  # interpreter shutdown
                pass


__all__ = ["LMPoolLM"]
