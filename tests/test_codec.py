"""Tensor codec and wire protocol: round trips and every kind of malformed input."""

from __future__ import annotations

import msgpack
import pytest
import torch

from shared import protocol
from shared.codec import decode_tensor, encode_tensor
from shared.errors import (
    InvalidRequest,
    ProtocolError,
    UnknownAdapter,
    WorkerError,
    error_from_wire,
    error_to_wire,
)

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (7,), (3, 5), (2, 3, 4)])
def test_tensor_round_trip_is_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(shape, generator=g) * 50).to(dtype)
    back = decode_tensor(encode_tensor(t), widen=False)
    assert back.dtype == dtype
    assert back.shape == t.shape
    assert torch.equal(back, t)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_half_rows_come_back_as_float32_within_their_precision(wire: torch.dtype) -> None:
    t = torch.log_softmax(torch.randn(49152, generator=torch.Generator().manual_seed(2)) * 3, -1)
    data = encode_tensor(t, wire)
    assert len(data) < 49152 * 2 + 64  # half the float32 bytes
    back = decode_tensor(data)
    assert back.dtype == torch.float32
    assert torch.equal(back, t.to(wire).float())


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_half_specials_widen_exactly(wire: torch.dtype) -> None:
    """Infinities, signed zeros, NaN and subnormals survive the widening, from bytes (a copy)
    as from a receive buffer."""
    t = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3.5, 6e4])
    half = t.to(wire)
    for data in (encode_tensor(half), bytearray(encode_tensor(half))):
        back = decode_tensor(data)
        assert back.dtype == torch.float32
        assert torch.equal(back.nan_to_num(7.0), half.float().nan_to_num(7.0))
        assert torch.equal(back.signbit(), half.float().signbit())


@pytest.mark.parametrize("row", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wire", [None, torch.float32, torch.float16, torch.bfloat16])
def test_a_half_models_rows_go_as_they_are_and_come_back_the_same(
    row: torch.dtype, wire: torch.dtype | None
) -> None:
    """Rows a 16-bit model computed (the hf and vLLM backends hand rows over in the model's
    dtype) are sent in it whatever the wire dtype: widened to float32 they are the values the
    float32 wire carried, in half the bytes; a float32 row is cast to a narrower wire dtype."""
    g = torch.Generator().manual_seed(5)
    rows = list(torch.log_softmax(torch.randn(3, 49152, generator=g) * 3, -1).to(row))
    for one_copy in (False, True):
        encoded = protocol.encode_results(rows, wire, one_copy=one_copy)
        for r, e in zip(rows, encoded, strict=True):
            data = protocol.wire_bytes(e)
            assert len(data) < 49152 * 2 + 64
            back = protocol.decode_result(data)
            assert back.dtype == torch.float32
            assert torch.equal(back, r.float())
            assert data == protocol.encode_result(r, wire)
    assert protocol.sent_dtype(row, wire) is None
    narrower = wire in (torch.float16, torch.bfloat16)
    assert protocol.sent_dtype(torch.float32, wire) is (wire if narrower else None)
    assert protocol.sent_dtype(torch.int64, wire) is wire  # only floats keep their own dtype


def test_decoded_tensor_is_writable_and_independent() -> None:
    t = torch.arange(4, dtype=torch.float32)
    wire = encode_tensor(t)
    back = decode_tensor(wire)
    back += 1  # a read-only buffer would raise here
    assert torch.equal(decode_tensor(wire), t)


def test_non_contiguous_and_large_vocab_vectors() -> None:
    t = torch.randn(8, 49152)[:, ::2]
    assert torch.equal(decode_tensor(encode_tensor(t)), t)


def test_elements_start_8_byte_aligned() -> None:
    for ndim in range(0, 9):
        t = torch.zeros((1,) * ndim)
        assert (len(encode_tensor(t)) - 4) % 8 == 0  # one float32 after the header


_GOOD = encode_tensor(torch.arange(3, dtype=torch.float32))


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"LPT",
        _GOOD[:-1],  # a byte short
        _GOOD + b"\0",  # a byte long
        b"XYZ" + _GOOD[3:],  # not a tensor
        _GOOD[:3] + b"\x09" + _GOOD[4:],  # another format version
        _GOOD[:4] + b"\x63" + _GOOD[5:],  # unknown dtype code
        _GOOD[:5] + b"\x09" + _GOOD[6:],  # too many dimensions
        _GOOD[:5] + b"\x02" + _GOOD[6:],  # a dimension whose size is missing
        _GOOD[:8] + b"\xff\xff\xff\xff" + _GOOD[12:],  # 4 G elements declared
    ],
)
def test_malformed_tensors_raise_protocol_error(bad: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_tensor(bad)


def _request(**changes: object) -> dict:
    req = {
        "v": protocol.PROTOCOL_VERSION,
        "kind": "logprobs",
        "digest": "d" * 40,
        "ids": b"\x01\0\0\0\x02\0\0\0",
        "lora": None,
        "params": {},
        "deadline_ms": 1,
    }
    req.update(changes)
    return req


def test_request_round_trip() -> None:
    req = _request(lora="a", params={"cont": [4]})
    assert protocol.decode_request(protocol.encode_request(req), 1 << 20) == req  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (msgpack.packb(_request(v=99)), "protocol version"),
        (msgpack.packb(_request(ids="123")), "ids"),
        (msgpack.packb(_request(ids=[1, 2])), "ids"),
        (msgpack.packb(_request(ids=b"\x01\0\0")), "not int32s"),
        (msgpack.packb(_request(extra=1), use_bin_type=True), "unknown request fields"),
        (msgpack.packb(_request(lora=3), use_bin_type=True), "lora"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb(_request())[:-5], "undecodable"),
        (b"\xc1", "undecodable"),
        (b"x" * 5000, "exceeds the limit"),
    ],
)
def test_bad_requests_raise_protocol_error(raw: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.decode_request(raw, 4096)


def test_decoder_caps_declared_lengths() -> None:
    # A 6-byte message that declares a 4 GiB binary must be refused, not allocated.
    hostile = b"\xc6\xff\xff\xff\xff" + b"a"
    with pytest.raises(ProtocolError):
        protocol.decode_request(hostile, 1024)


def test_result_and_reply_round_trip() -> None:
    small = protocol.encode_result(torch.tensor([3, 1, 4]))
    digest, body = protocol.decode_reply(protocol.encode_reply("abc", small))
    assert digest == "abc"
    assert isinstance(body, bytes)
    assert protocol.decode_result(body).tolist() == [3, 1, 4]
    # a vocabulary row stays in the cache: the reply only names its digest
    row = protocol.encode_result(torch.log_softmax(torch.randn(49152), -1))
    reply = protocol.encode_reply("abc", row)
    assert len(reply) < 100
    assert protocol.decode_reply(reply) == ("abc", None)


def test_error_replies_become_typed_errors() -> None:
    wire = error_to_wire(InvalidRequest("token id 7 is bad"))
    digest, err = protocol.decode_reply(protocol.encode_reply("abc", error=wire))
    assert digest == "abc"
    assert isinstance(err, InvalidRequest)
    assert "token id 7" in str(err)
    assert type(error_from_wire("no-such-code", "x")).__name__ == "LMPoolError"


def test_an_error_rebuilt_from_the_wire_names_its_class_once() -> None:
    """The producer raises the class the code names: a message that repeated it printed
    ``InvalidRequest: InvalidRequest: ...``. Other exceptions become ``WorkerError`` and keep
    their own class name in the message."""
    for error in (InvalidRequest("temperature must be > 0"), UnknownAdapter("unknown 'x'")):
        rebuilt = error_from_wire(**error_to_wire(error))
        assert type(rebuilt) is type(error)
        assert str(rebuilt) == str(error)
    rebuilt = error_from_wire(**error_to_wire(RuntimeError("CUDA out of memory")))
    assert type(rebuilt) is WorkerError
    assert str(rebuilt) == "RuntimeError: CUDA out of memory"


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    try:
        req = protocol.decode_request(data, 4096)
    except ProtocolError:
        return
    assert req["v"] == protocol.PROTOCOL_VERSION


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "v": st.one_of(st.just(protocol.PROTOCOL_VERSION), _values),
            "kind": _values,
            "digest": _values,
            "ids": _values,
            "lora": _values,
            "params": _values,
            "deadline_ms": _values,
        },
    )
)
def test_fuzz_structured_messages_never_crash_the_decoder(obj: dict) -> None:
    try:
        req = protocol.decode_request(msgpack.packb(obj, use_bin_type=True), 4096)
    except ProtocolError:
        return
    assert isinstance(req["ids"], bytes) and isinstance(req["digest"], str)


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(max_size=64), st.binary(max_size=64))
def test_fuzz_tensor_decoder(head: bytes, tail: bytes) -> None:
    for data in (head, _GOOD[:8] + head + tail, _GOOD[: len(head) % 24] + tail):
        try:
            t = decode_tensor(data)
        except ProtocolError:
            continue
        assert t.numel() * t.element_size() <= len(data)


@pytest.mark.parametrize("wire", [None, torch.float32, torch.float16, torch.bfloat16])
def test_a_steps_rows_encoded_together_as_one_by_one(wire: torch.dtype | None) -> None:
    """``encode_results``' one-copy path (taken for rows on a GPU) gives each row the bytes
    that encoding it alone gives; rows of different shapes or dtypes go one by one. Either
    way a row comes in parts whose elements are not copied on the CPU: in float32 they are the
    row's own memory."""
    g = torch.Generator().manual_seed(3)
    rows = list(torch.log_softmax(torch.randn(5, 1000, generator=g), -1))
    alone = [protocol.encode_result(r, wire) for r in rows]

    def joined(encoded: list[protocol.Encoded]) -> list[bytes]:
        assert all(protocol.wire_len(e) == len(protocol.wire_bytes(e)) for e in encoded)
        return [protocol.wire_bytes(e) for e in encoded]

    assert joined(protocol.encode_results(rows, wire, one_copy=True)) == alone
    assert joined(protocol.encode_results(rows, wire)) == alone
    mixed = [*rows, torch.arange(4)]
    assert joined(protocol.encode_results(mixed, wire, one_copy=True)) == [
        *alone,
        protocol.encode_result(torch.arange(4), wire),
    ]
    assert protocol.encode_results([], wire, one_copy=True) == []
    if wire in (None, torch.float32):
        _, body = protocol.encode_results(rows, wire)[2]
        assert isinstance(body, memoryview) and body.nbytes == 4000
        rows[2][7] = 1.5  # the view sees the row's memory
        assert body[28:32].tobytes() == rows[2][7:8].numpy().tobytes()
