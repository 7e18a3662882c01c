"""The wire protocol: typed messages, msgpack only, a protocol version in every message.

A producer adds a :class:`Request` to a shard's stream (field ``m``, with the digest alone in
field ``d`` so that even an undecodable message can be answered). A worker stores the encoded
result under the request's content digest (the shared output cache) and pushes a small
:class:`Reply` onto the reply list of every producer waiting for that digest: the result itself
when it is small (samples, scores, errors), else only the digest, and the producer reads the
result from the cache. A vocabulary-sized row thus enters Redis once and leaves it once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import msgpack
import torch

from shared.codec import cast, decode_tensor, encode_tensor, tensor_parts
from shared.errors import LMPoolError, ProtocolError, WireError, error_from_wire

PROTOCOL_VERSION = 2
KINDS = ("logprobs", "sample", "score", "cache_kv")
MAX_SAMPLE_TOKENS = 1_000_000
"""The most ``max_tokens`` a ``sample`` request may ask for (the model's context caps it too)."""
MESSAGE_FIELD = b"m"
"""Stream entry field that holds the encoded request."""
DIGEST_FIELD = b"d"
"""Stream entry field that holds the request's digest, readable without decoding ``m``."""
CARRIED_FIELD = b"k"
"""Stream entry field: deliveries of the entries it replaced (SUBMIT re-adds a request whose
holder died; absent: none)."""
MAX_INLINE_RESULT_BYTES = 4096
"""Results up to this size travel inside the reply; larger ones are read from the cache."""
MAX_REPLY_BYTES = 1 << 20
ID_BYTES = 4
"""Token ids travel as little-endian 32-bit integers."""


class Request(TypedDict):
    """One request on a shard's stream."""

    v: int
    """Protocol version (``PROTOCOL_VERSION``)."""
    kind: str
    """``logprobs`` (next-token distribution), ``sample`` (a generation), ``score``, or
    ``cache_kv`` (pin or unpin a prefix in the serving worker's KV cache; never cached)."""
    digest: str
    """Content address of the result; the worker recomputes it and refuses a mismatch."""
    ids: bytes
    """Prompt token ids, packed little-endian int32."""
    lora: str | None
    """LoRA adapter name, or None for the base model."""
    params: dict[str, Any]
    """Kind-specific parameters: ``sample``: max_tokens, eos, temperature (0: greedy), seed;
    ``score``: cont (continuation token ids) and, optionally, greedy (true: the result is
    ``[n, 2]``, each token's log-prob and 1.0 where the token is the argmax of its position,
    ties going to the lowest id as ``torch.argmax``; absent: ``[n]`` log-probs);
    ``cache_kv``: pin (bool)."""
    deadline_ms: int
    """Time (ms, on the Redis server's clock) after which the asker no longer waits: a worker
    drops the request unrun and answers ``Expired``."""


class Reply(TypedDict, total=False):
    """What a waiting producer receives on its reply list."""

    v: int
    """Protocol version."""
    digest: str
    """Which request this answers."""
    result: bytes
    """The encoded result, when small; absent: read it from the digest's result key."""
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


def tokens_read(kind: str, n_ids: int, params: Mapping[str, Any]) -> tuple[int, str]:
    """How many tokens the model reads for a request of ``n_ids`` prompt tokens (what its
    context must hold), and what they are, for the limit's message: a score's continuation but
    its last token, a generation's tokens but the last one it draws."""
    if kind == "score":
        return n_ids + len(params["cont"]) - 1, "prompt and continuation (less its last token)"
    if kind == "sample":
        return n_ids + max(0, params["max_tokens"] - 1), "prompt and max_tokens - 1"
    return n_ids, "prompt"


def message_bytes(n_ids: int, params: dict[str, Any] | None = None) -> int:
    """An upper bound of the encoded size of a request of ``n_ids`` tokens and ``params`` (for
    the producer's size check before it builds one): the ids, the parameters as they are sent
    (a score's continuation: a msgpack list, up to 5 bytes an id), 512 bytes for the rest."""
    return ID_BYTES * n_ids + (len(pack(params)) if params else 0) + 512


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "digest": str,
    "ids": bytes,
    "params": dict,
    "deadline_ms": int,
}


def decode_request(data: bytes, max_bytes: int) -> Request:
    """Decode and type-check a request; every defect raises ``ProtocolError``."""
    obj = _check_version(_unpack(data, max_bytes), "request")
    for name, typ in _FIELDS.items():
        if not isinstance(obj.get(name), typ):
            raise ProtocolError(f"request field {name!r} missing or of the wrong type")
    if len(obj["ids"]) % ID_BYTES:
        raise ProtocolError(f"request ids of {len(obj['ids'])} bytes are not int32s")
    if obj.get("lora") is not None and not isinstance(obj["lora"], str):
        raise ProtocolError("request field 'lora' must be a string or nil")
    obj.setdefault("lora", None)
    unknown = set(obj) - set(Request.__annotations__)
    if unknown:
        raise ProtocolError(f"unknown request fields {sorted(unknown)}")
    return obj  # type: ignore[return-value]


def sent_dtype(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype | None:
    """The cast a result of ``dtype`` gets when rows go in ``wire``: none where it is a float no
    wider than ``wire`` (a bfloat16 model's rows stay bfloat16 under the float32 default: the
    same values once widened, in half the bytes), else to ``wire``."""
    if (
        wire is not None
        and dtype.is_floating_point
        and wire.is_floating_point
        and dtype.itemsize <= wire.itemsize
    ):
        return None
    return wire


def encode_result(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> bytes:
    """Encoded result value: what the shared cache stores (rows in ``dtype`` at most: see
    ``sent_dtype``)."""
    return encode_tensor(tensor, sent_dtype(tensor.dtype, dtype))


Encoded = bytes | tuple[bytes, memoryview]
"""An encoded result: its bytes, or (a worker's rows) the header and a view of the tensor's
memory (``tensor_parts``), sent as one value without being joined (``shared.resp``)."""


def wire_bytes(encoded: Encoded) -> bytes:
    """The bytes of an encoded result (joined, if in parts)."""
    return encoded if isinstance(encoded, bytes) else b"".join(encoded)


def wire_len(encoded: Encoded) -> int:
    """Its length in bytes."""
    return len(encoded) if isinstance(encoded, bytes) else sum(len(p) for p in encoded)


def encode_results(
    tensors: list[torch.Tensor], dtype: torch.dtype | None = None, one_copy: bool | None = None
) -> list[Encoded]:
    """``encode_result`` of each of ``tensors``, in parts (``tensor_parts``: a step's 64 rows
    are 12.5 MB, which a join would copy once more before the socket); a step's rows on an
    accelerator (same shape, dtype and device) are stacked, cast and copied to the host
    together: one device-to-host copy and one wait for the device per step instead of one per
    row. ``one_copy`` forces the choice (tests); by default it is taken for tensors off the
    CPU, where rows need no copy."""
    if not tensors:
        return []
    first = tensors[0]
    if one_copy is None:
        one_copy = first.device.type != "cpu"
    alike = all(
        t.shape == first.shape and t.dtype == first.dtype and t.device == first.device
        for t in tensors
    )
    if not (one_copy and alike and len(tensors) > 1):
        return [tensor_parts(t, sent_dtype(t.dtype, dtype)) for t in tensors]
    stacked = torch.stack([t.detach() for t in tensors])
    to = sent_dtype(first.dtype, dtype)
    host = (stacked if to is None else cast(stacked, to)).cpu()
    return [tensor_parts(row) for row in host]


def decode_result(data: bytes | bytearray) -> torch.Tensor:
    """The result tensor: float16 / bfloat16 rows come back as float32."""
    return decode_tensor(data)


def encode_reply(
    digest: str, result: Encoded | None = None, error: WireError | None = None
) -> bytes:
    """A reply: with an error, with a small result inline, or with neither (fetch it)."""
    reply: Reply = {"v": PROTOCOL_VERSION, "digest": digest}
    if error is not None:
        reply["error"] = error
    elif result is not None and wire_len(result) <= MAX_INLINE_RESULT_BYTES:
        reply["result"] = wire_bytes(result)
    return pack(reply)


def decode_reply(data: bytes) -> tuple[str, bytes | LMPoolError | None]:
    """``(digest, outcome)``: the inline encoded result, the typed error, or None when the
    result is to be read from the cache."""
    obj = _check_version(_unpack(data, MAX_REPLY_BYTES), "reply")
    digest = obj.get("digest")
    if not isinstance(digest, str):
        raise ProtocolError("reply without a digest")
    if "error" in obj:
        err = obj["error"]
        if not isinstance(err, dict):
            raise ProtocolError("reply error must be a map")
        return digest, error_from_wire(str(err.get("code")), str(err.get("message")))
    result = obj.get("result")
    if result is not None and not isinstance(result, bytes):
        raise ProtocolError("reply result must be bytes")
    return digest, result


def canonical_params(kind: str, params: dict[str, Any]) -> bytes:
    """Deterministic bytes of the parameters that change a result (part of its digest)."""
    return pack(sorted(params.items())) if params else b""
