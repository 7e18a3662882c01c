"""lmpool's works as vLLM requests, and vLLM's request outputs as their results.

- ``logprobs``: ``max_tokens=1`` with a capture tag; the capture logits processor
  (:mod:`.capture`) writes the request's full ``log_softmax`` row in the process that runs the
  model, and :mod:`.rows` fetches it.
- ``sample``: vLLM's sampler with a per-request seed (same seed, same tokens, alone or in a
  batch); only the caller's EOS ids stop it, and the EOS is not returned.
- ``score``: the prompt and the continuation but its last token, ``prompt_logprobs=0``
  (``log_softmax`` in float32 of the same logits at every prompt position; such requests skip
  reading the prefix cache) and a capture tag: the last token's log-prob is read from the
  captured row of the position before it, so that a score fits the context as a next-token
  request of the same tokens read does (vLLM holds a prompt and at least one token to
  generate); several run in one step. With ``greedy``, a token is the argmax of its position
  when vLLM ranks it 1 (vLLM's rank counts the ids whose log-prob is >= the token's, so on an
  exact tie no token is greedy, where ``torch.argmax`` picks the lowest id); the last token's
  rank is counted the same way in its row.
- ``cache_kv``: a prefill (``max_tokens=1``) that leaves the prompt's blocks in vLLM's prefix
  cache, evictable like any other; 1 when prefix caching is on.
"""

from __future__ import annotations

from typing import Any

import torch

from shared.errors import LMPoolError
from worker.backends.base import Work

KINDS = ("logprobs", "sample", "score", "cache_kv")


def sampling_params(work: Work, tag: str, capture_key: str, prefix_caching: bool) -> Any:
    """vLLM's ``SamplingParams`` for ``work`` (request id ``tag``; ``capture_key``: the capture
    module's ``CAPTURE_KEY``), or None when the work is answered without the engine (its
    ``result`` is set then)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    final = RequestOutputKind.FINAL_ONLY
    if work.kind == "logprobs":
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            output_kind=final,
            extra_args={capture_key: tag},
        )
    if work.kind == "sample":
        p = work.params
        if int(p["max_tokens"]) <= 0:
            work.result = torch.tensor([], dtype=torch.int64)
            return None
        seed = p.get("seed")
        return SamplingParams(
            max_tokens=int(p["max_tokens"]),
            temperature=float(p["temperature"]),
            seed=None if seed is None else int(seed),
            ignore_eos=True,  # only the caller's EOS ids end the generation
            stop_token_ids=sorted({int(t) for t in p.get("eos", [])}),
            detokenize=False,
            output_kind=final,
        )
    if work.kind == "score":
        if not list(work.params["cont"]):
            work.result = torch.zeros((0, 2) if work.params.get("greedy") else 0)
            return None
        within = len(work.params["cont"]) > 1  # tokens read from prompt log-probs
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=0 if within else None,
            skip_reading_prefix_cache=within,
            detokenize=False,
            output_kind=final,
            extra_args={capture_key: tag},
        )
    # cache_kv: vLLM cannot pin; a prefill leaves the blocks in its prefix cache
    if not work.params.get("pin", True) or not prefix_caching:
        work.result = torch.tensor([0], dtype=torch.int64)
        return None
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=final)


def prompt_ids(work: Work) -> list[int]:
    """The token ids vLLM runs for ``work`` (a score's continuation but its last token is part
    of its prompt)."""
    return work.ids + list(work.params["cont"])[:-1] if work.kind == "score" else work.ids


def output_result(work: Work, output: Any, prefix_caching: bool) -> torch.Tensor | None:
    """``work``'s result from vLLM's finished ``RequestOutput``; None for ``logprobs`` works,
    whose rows are captured apart; for ``score`` works, what the prompt's log-probs give (the
    continuation but its last token: :func:`score_result` adds it from the captured row).
    Raises when vLLM ended the request otherwise."""
    completion = output.outputs[0] if output.outputs else None
    if completion is not None and completion.finish_reason in ("abort", "error"):
        raise RuntimeError(f"vLLM ended the request: {completion.finish_reason}")
    if work.kind == "logprobs":
        return None
    if work.kind == "sample":
        assert completion is not None
        tokens = [int(t) for t in completion.token_ids]
        if tokens and tokens[-1] in set(work.params.get("eos", [])):
            tokens.pop()  # genlm-backend's semantics: EOS not appended
        return torch.tensor(tokens, dtype=torch.int64)
    if work.kind == "score":
        full = prompt_ids(work)
        positions = output.prompt_logprobs
        picked = [positions[i][full[i]] for i in range(len(work.ids), len(full))]
        values = torch.tensor([p.logprob for p in picked], dtype=torch.float32)
        if not work.params.get("greedy"):
            return values
        top = torch.tensor([float(p.rank == 1) for p in picked], dtype=torch.float32)
        return torch.stack([values, top], dim=1)
    return torch.tensor([int(prefix_caching)], dtype=torch.int64)


def score_result(work: Work, within: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """A score's result: ``within`` (from :func:`output_result`) and its last token's log-prob
    in ``row``, the captured float32 row of the position before it."""
    last = int(work.params["cont"][-1])
    value = row[last].float().reshape(1)
    if not work.params.get("greedy"):
        return torch.cat([within, value])
    top = float(int((row >= row[last]).sum()) == 1)  # vLLM's rank 1
    return torch.cat([within, torch.tensor([[float(value), top]], dtype=torch.float32)])


def client_error(error: BaseException) -> bool:
    """vLLM's refusal of a request (out-of-vocabulary id, too long...), not an engine fault."""
    if isinstance(error, LMPoolError):
        return False
    if isinstance(error, ValueError):
        return True
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # pragma: no cover - older vLLM
        return False
    return isinstance(error, VLLMClientError)
