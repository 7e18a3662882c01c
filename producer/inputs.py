"""What callers hand ``RemoteLM``, checked and normalized before anything is sent."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shared import protocol
from shared.errors import InvalidRequest

TOKENIZE_HINT = "tokenize text first, e.g. lm.tokenizer.encode(text)"
"""What an error about text given as token ids suggests."""


def token_array(token_ids: Any, vocab_size: int, what: str = "prompt") -> np.ndarray:
    """Token ids as a little-endian int32 array, checked in time linear in their number.

    Accepts what genlm-backend accepts (Python ints, numpy integers, 0-d integer tensors, in a
    list or tuple) and 1-D integer arrays and tensors; anything else raises ``InvalidRequest``,
    whose message names ``what`` the ids are (``"prompt"``, ``"continuation"``).
    """
    if isinstance(token_ids, (str, bytes)):
        raise InvalidRequest(
            f"{what} token ids must be integers, not {type(token_ids).__name__} "
            f"{token_ids[:40]!r}: {TOKENIZE_HINT}"
        )
    if isinstance(token_ids, torch.Tensor):
        arr = token_ids.detach().cpu().numpy()
    elif isinstance(token_ids, np.ndarray):
        arr = token_ids
    else:
        try:
            arr = np.asarray(token_ids)
        except (ValueError, TypeError, OverflowError, RuntimeError) as e:
            raise InvalidRequest(
                f"{what} token ids must be a flat sequence of integers: {e}"
            ) from None
    if arr.ndim == 0:
        single = arr.dtype.kind in "iu"
        raise InvalidRequest(
            f"{what} token ids must be a sequence, not {type(token_ids).__name__} "
            f"{str(token_ids)[:40]}" + (f": one token is [{token_ids}]" if single else "")
        )
    if arr.ndim != 1:
        raise InvalidRequest(
            f"{what} token ids must be one flat sequence, not of shape {arr.shape}"
        )
    if arr.size == 0:
        raise InvalidRequest(f"empty {what}: at least one token id is needed")
    if arr.dtype.kind in "fO" and isinstance(token_ids, (list, tuple)):
        arr = _python_ints(token_ids, arr, vocab_size, what)
    if arr.dtype.kind not in "iu":
        bad = next((x for x in arr.tolist() if type(x) is not int), arr[0])
        hint = f": {TOKENIZE_HINT}" if arr.dtype.kind in "US" else ""
        raise InvalidRequest(
            f"{what} token id {bad!r} is not an integer in [0, {vocab_size}){hint}"
        )
    outside = (arr < 0) | (arr >= vocab_size)
    if outside.any():
        bad = arr[int(np.argmax(outside))]
        raise InvalidRequest(f"{what} token id {int(bad)} is not an integer in [0, {vocab_size})")
    return arr.astype("<i4", copy=False)


def _python_ints(ids: list[Any] | tuple[Any, ...], arr: np.ndarray, vocab: int, what: str) -> Any:
    """Integers numpy made floats or objects of (a numpy uint64 beside an int, an int past 64
    bits): checked one by one; ``arr`` back when they are not all integers."""
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in ids):
        return arr
    bad = next((int(x) for x in ids if not 0 <= int(x) < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{what} token id {bad} is not an integer in [0, {vocab})")
    return np.array([int(x) for x in ids], dtype="<i4")


def sample_params(
    max_tokens: int, eos_token_ids: Sequence[int], temperature: float, seed: int | None
) -> dict[str, Any]:
    try:
        params: dict[str, Any] = {
            "max_tokens": int(max_tokens),
            "eos": [int(t) for t in eos_token_ids],
            "temperature": float(temperature),
            "seed": int(seed) if seed is not None else secrets.randbits(62),
        }
    except (TypeError, ValueError) as e:
        raise InvalidRequest(
            "max_tokens, temperature and seed must be numbers, eos_token_ids a list of token "
            f"ids: {e}"
        ) from None
    if not params["temperature"] >= 0:
        raise InvalidRequest(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if not -(1 << 63) <= params["seed"] < 1 << 64:
        raise InvalidRequest(f"seed must be an int of 64 bits at most, got {seed!r}")
    if not 0 <= params["max_tokens"] <= protocol.MAX_SAMPLE_TOKENS:
        raise InvalidRequest(
            f"max_tokens must be an int in [0, {protocol.MAX_SAMPLE_TOKENS}], got {max_tokens!r}"
        )
    return params
