"""The wire protocol: typed messages, msgpack only, a protocol version in every message.

A producer adds a :class:`Request` to a model's stream (field ``m``). A worker stores the
encoded result under the request's content digest (the shared output cache) and pushes a
:class:`Reply` onto the reply list of every producer waiting for that digest.
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgpack
import torch

from shared.codec import TensorDict, decode_tensor, encode_tensor
from shared.errors import LMPoolError, ProtocolError, WireError, error_from_wire

PROTOCOL_VERSION = 1
KINDS = ("logprobs", "sample", "score", "cache_kv")
MESSAGE_FIELD = b"m"
"""Stream entry field that holds the encoded request."""
MAX_RESULT_BYTES = 1 << 30


class Request(TypedDict):
    """One request on a model's stream."""

    v: int
    """Protocol version (``PROTOCOL_VERSION``)."""
    kind: str
    """``logprobs`` (next-token distribution), ``sample`` (a generation), ``score``, or
    ``cache_kv`` (pin a prefix in the serving worker's KV cache; never cached in Redis)."""
    digest: str
    """Content address of the result; the worker recomputes it and refuses a mismatch."""
    ids: list[int]
    """Prompt token ids."""
    lora: str | None
    """LoRA adapter name, or None for the base model."""
    params: dict[str, Any]
    """Kind-specific parameters: ``sample``: max_tokens, eos, temperature, seed;
    ``score``: cont (continuation token ids)."""
    deadline_ms: int
    """Unix time (ms) after which nobody waits for the answer: the worker skips it."""
    client: str
    """Producer connection id, for logs."""


class Reply(TypedDict, total=False):
    """What a waiting producer receives on its reply list."""

    v: int
    """Protocol version."""
    digest: str
    """Which request this answers."""
    result: bytes
    """Encoded result (``encode_result``), present when the request succeeded."""
    error: WireError
    """Present when the request failed."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes, max_bytes: int) -> Any:
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("message must be bytes")
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        # Length caps keep a hostile message from allocating more than its own size suggests.
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=1024,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"undecodable message: {e}") from None


def _check_version(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be a map")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{what} has protocol version {obj.get('v')!r}; this side speaks {PROTOCOL_VERSION}"
        )
    return obj


def encode_request(req: Request) -> bytes:
    return pack(req)


def decode_request(data: bytes, max_bytes: int) -> Request:
    """Decode and type-check a request; every defect raises ``ProtocolError``."""
    obj = _check_version(_unpack(data, max_bytes), "request")
    expected: dict[str, Any] = {
        "kind": str,
        "digest": str,
        "ids": list,
        "params": dict,
        "deadline_ms": int,
        "client": str,
    }
    for name, typ in expected.items():
        if not isinstance(obj.get(name), typ):
            raise ProtocolError(f"request field {name!r} missing or not a {typ.__name__}")
    if obj.get("lora") is not None and not isinstance(obj["lora"], str):
        raise ProtocolError("request field 'lora' must be a string or nil")
    obj.setdefault("lora", None)
    if set(obj) - set(Request.__annotations__):
        raise ProtocolError(
            f"unknown request fields {sorted(set(obj) - set(Request.__annotations__))}"
        )
    return obj  # type: ignore[return-value]


def encode_result(tensor: torch.Tensor) -> bytes:
    """Encoded result value: what the shared cache stores and replies carry."""
    out: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": encode_tensor(tensor)}
    return pack(out)


def decode_result(data: bytes) -> torch.Tensor:
    obj = _check_version(_unpack(data, MAX_RESULT_BYTES), "result")
    t: TensorDict = obj.get("t")  # type: ignore[assignment]
    return decode_tensor(t)


def encode_reply(digest: str, result: bytes | None = None, error: WireError | None = None) -> bytes:
    reply: Reply = {"v": PROTOCOL_VERSION, "digest": digest}
    if error is not None:
        reply["error"] = error
    else:
        assert result is not None
        reply["result"] = result
    return pack(reply)


def decode_reply(data: bytes) -> tuple[str, bytes | LMPoolError]:
    """``(digest, encoded result or the typed error)``."""
    obj = _check_version(_unpack(data, MAX_RESULT_BYTES), "reply")
    digest = obj.get("digest")
    if not isinstance(digest, str):
        raise ProtocolError("reply without a digest")
    if "error" in obj:
        err = obj["error"]
        return digest, error_from_wire(str(err.get("code")), str(err.get("message")))
    result = obj.get("result")
    if not isinstance(result, bytes):
        raise ProtocolError("reply without a result")
    return digest, result


def canonical_params(kind: str, params: dict[str, Any]) -> bytes:
    """Deterministic bytes of the parameters that change a result (part of its digest)."""
    return pack(sorted(params.items())) if params else b""
