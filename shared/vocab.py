"""Byte vocabulary of a Hugging Face tokenizer, as genlm-backend 0.3.1 decodes it.

genlm-control walks a language model's ``byte_vocab`` to build character tries and to map
sampled bytes back to token ids, so a remote LM must hand out exactly the list genlm-backend's
``decode_vocab`` would: one :class:`Token` per vocabulary index, carrying the raw bytes the
token stands for. The decoding depends on how the tokenizer encodes bytes:

* byte-level BPE (GPT-2, SmolLM2, Llama 3...): every byte is drawn as a printable character
  of the GPT-2 alphabet, so token strings are mapped back through that alphabet;
* SentencePiece (Llama 2, Gemma...): ``▁`` stands for a space and ``<0xNN>`` pieces are raw
  byte fallbacks.

Special (added) tokens are never mapped through an alphabet; their text is UTF-8 encoded.
Several ids may decode to the same bytes (``<0x20>`` and ``▁`` are both a space); they stay
distinct tokens, told apart by ``token_id``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal

__all__ = [
    "ByteDecoderError",
    "ByteVocabError",
    "Token",
    "bytes_to_strs",
    "decode_vocab",
    "get_byte_vocab",
]

Byte2StrFallback = Literal["tokenizer", "latin1", "replace"]
BYTE2STR_FALLBACKS: tuple[str, ...] = ("tokenizer", "latin1", "replace")

# Decoder component names that say which byte encoding a fast tokenizer uses.
_SENTENCEPIECE_DECODERS = frozenset({"ByteFallback", "Metaspace"})
_BYTE_LEVEL_DECODER = "ByteLevel"

_SP_SPACE = "▁".encode()
_SP_BYTE_PIECE = re.compile(rb"<0x(..)>")

# Characters that tokenizers use for a byte but the GPT-2 alphabet does not list.
_EXTRA_BYTE_CHARS = {" ": 32, "\n": 10, "\r": 13, "\t": 9, "▁": 32}

# A string whose tokens cover multi-byte UTF-8 and rare scripts: a byte decoder that
# round-trips it is trusted for the whole vocabulary.
_ROUNDTRIP_PROBE = "’•¶∂ƒ˙∆£Ħ爨ൠᅘ∰፨"


class Token(bytes):
    """One vocabulary entry: the bytes it decodes to, and its id.

    It is ``bytes`` so that ``b"".join(tokens)``, ``len``, slicing and ``.decode()`` work
    unchanged, but two tokens compare and hash by ``token_id``: distinct ids may share their
    bytes and must stay distinct in sets, dict keys and tries. A token compared with plain
    ``bytes`` falls back to comparing content. Ordering between tokens is by id.
    """

    token_id: int

    def __new__(cls, token_id: int, byte_string: bytes) -> Token:
        if not isinstance(token_id, int):
            raise TypeError(f"token_id must be an int, got {type(token_id)}")
        if not isinstance(byte_string, bytes):
            raise TypeError(f"byte_string must be bytes, got {type(byte_string)}")
        obj = super().__new__(cls, byte_string)
        obj.token_id = token_id
        return obj

    @property
    def byte_string(self) -> bytes:
        """The token's bytes as a plain ``bytes`` object."""
        return bytes(self)

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id}, byte_string={bytes(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id != other.token_id
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.token_id)

    def __lt__(self, other: bytes) -> bool:
        if not isinstance(other, Token):
            return NotImplemented
        return self.token_id < other.token_id

    def __le__(self, other: bytes) -> bool:
        if not isinstance(other, Token):
            return NotImplemented
        return self.token_id <= other.token_id

    def __gt__(self, other: bytes) -> bool:
        if not isinstance(other, Token):
            return NotImplemented
        return self.token_id > other.token_id

    def __ge__(self, other: bytes) -> bool:
        if not isinstance(other, Token):
            return NotImplemented
        return self.token_id >= other.token_id

    @staticmethod
    def as_bytes(x: Any) -> Any:
        """The bytes of a token; anything else is returned unchanged."""
        return x.byte_string if isinstance(x, Token) else x

    @staticmethod
    def is_plain_bytes(x: object) -> bool:
        """Whether ``x`` is ``bytes`` but not a :class:`Token`."""
        return isinstance(x, bytes) and not isinstance(x, Token)

    def __reduce__(self) -> tuple[type[Token], tuple[int, bytes]]:
        # bytes pickles by content only; the id must travel too.
        return (Token, (self.token_id, bytes(self)))


class ByteDecoderError(Exception):
    """A byte decoder cannot map some token of the tokenizer back to its bytes."""


class ByteVocabError(Exception):
    """The byte encoding of a tokenizer's vocabulary cannot be determined."""


def decode_vocab(
    tokenizer: Any, byte2str_fallback: Byte2StrFallback | str = "tokenizer"
) -> tuple[list[Token], list[str]]:
    """The byte and string vocabularies of ``tokenizer``, indexed by token id.

    The byte vocabulary is canonical: ``byte_vocab[i]`` is a :class:`Token` with
    ``token_id == i``, which the tries and weight arrays rely on. The string vocabulary is a
    convenience; a token that is not valid UTF-8 on its own (half a multi-byte character) is
    rendered by ``byte2str_fallback``: ``"tokenizer"`` (its piece as the tokenizer spells it),
    ``"latin1"`` (one character per byte) or ``"replace"`` (``U+FFFD``).

    Raises:
        ValueError: unknown fallback, or a tokenizer whose byte encoding cannot be decoded.
    """
    if byte2str_fallback not in BYTE2STR_FALLBACKS:
        raise ValueError(f"Unknown byte2str_fallback strategy: {byte2str_fallback}")
    try:
        raw_byte_vocab = get_byte_vocab(tokenizer)
    except ByteVocabError as e:
        raise ValueError(
            "Could not decode byte representation of token vocabuary from tokenizer "
            f"{tokenizer.name_or_path}"
        ) from e
    byte_vocab = [Token(token_id=i, byte_string=b) for i, b in enumerate(raw_byte_vocab)]
    return byte_vocab, bytes_to_strs(tokenizer, raw_byte_vocab, byte2str_fallback)


def bytes_to_strs(
    tokenizer: Any, byte_vocab: Sequence[bytes], byte2str_fallback: Byte2StrFallback | str
) -> list[str]:
    """UTF-8 strings of ``byte_vocab``; invalid UTF-8 is rendered by ``byte2str_fallback``.

    Different ids may map to the same string; that is expected and not reported.
    """
    return [
        _token_str(tokenizer, token_id, raw, byte2str_fallback)
        for token_id, raw in enumerate(byte_vocab)
    ]


def _token_str(tokenizer: Any, token_id: int, raw: bytes, fallback: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    if fallback == "latin1":
        return raw.decode("latin1")  # every byte sequence is valid latin-1
    if fallback == "replace":
        return raw.decode("utf-8", errors="replace")
    piece: str = tokenizer.convert_ids_to_tokens(token_id)
    return piece


def get_byte_vocab(tokenizer: Any) -> list[bytes]:
    """The bytes of every token of ``tokenizer``, by id.

    The tokenizer's backend decoder says which encoding to undo: ``ByteFallback`` or
    ``Metaspace`` mean SentencePiece pieces, ``ByteLevel`` the GPT-2 byte alphabet; any other
    declared decoder is refused rather than guessed. A tokenizer with no backend to inspect
    (a slow tokenizer) is read as SentencePiece if it has an ``sp_model``, else through its own
    ``byte_decoder`` or the GPT-2 alphabet, provided that decoder round-trips.

    Raises:
        ByteVocabError: the encoding is unknown or the byte decoder does not round-trip.
    """
    kinds = _decoder_kinds(tokenizer)
    if kinds & _SENTENCEPIECE_DECODERS:
        return get_byte_tokens_from_sp(tokenizer)
    if _BYTE_LEVEL_DECODER in kinds:
        return _byte_level_vocab(
            tokenizer,
            default_byte_decoder(),
            "Tokenizer declares a ByteLevel decoder but does not round-trip under "
            "the GPT-2 byte alphabet.",
        )
    if kinds:
        raise ByteVocabError(
            f"Cannot determine the byte encoding of {tokenizer.name_or_path!r}: its "
            f"decoder is {sorted(kinds)}, which is neither ByteLevel nor SentencePiece."
        )
    if hasattr(tokenizer, "sp_model"):
        return get_byte_tokens_from_sp(tokenizer)
    return _byte_level_vocab(
        tokenizer,
        getattr(tokenizer, "byte_decoder", None) or default_byte_decoder(),
        f"Tokenizer {tokenizer.name_or_path!r} exposes no decoder to inspect and "
        "does not round-trip under the GPT-2 byte alphabet.",
    )


def _byte_level_vocab(tokenizer: Any, byte_decoder: dict[str, int], error: str) -> list[bytes]:
    """Byte vocabulary through ``byte_decoder``, once it is shown to round-trip."""
    try:
        check_byte_decoder(tokenizer, byte_decoder)
    except ByteDecoderError as e:
        raise ByteVocabError(error) from e
    return get_byte_tokens_from_byte_decoder(tokenizer, byte_decoder)


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """Type names of every component of the backend decoder; empty without a backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    kinds: set[str] = set()
    _collect_types(json.loads(backend.to_str()).get("decoder"), kinds)
    return kinds


def _collect_types(node: object, kinds: set[str]) -> None:
    """Add every ``"type"`` string found in a decoder's JSON tree (``Sequence`` nests)."""
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            kinds.add(node["type"])
        for value in node.values():
            _collect_types(value, kinds)
    elif isinstance(node, list):
        for value in node:
            _collect_types(value, kinds)


def _special_tokens_by_id(tokenizer: Any) -> dict[int, str]:
    """Added tokens by id: their text is literal, not in the model's byte encoding."""
    return {token_id: text for text, token_id in tokenizer.get_added_vocab().items()}


def get_byte_tokens_from_byte_decoder(tokenizer: Any, byte_decoder: dict[str, int]) -> list[bytes]:
    """Bytes of every token by mapping each character of its piece through ``byte_decoder``."""
    special = _special_tokens_by_id(tokenizer)
    return [
        special[i].encode()
        if i in special
        else bytes(byte_decoder[c] for c in tokenizer.convert_ids_to_tokens(i))
        for i in range(len(tokenizer))
    ]


def get_byte_tokens_from_sp(tokenizer: Any) -> list[bytes]:
    """Bytes of every SentencePiece piece: ``<0xNN>`` is byte NN, ``▁`` is a space."""
    special = _special_tokens_by_id(tokenizer)
    return [
        _sp_piece_bytes(
            special[i].encode() if i in special else _unescape_byte_pieces(tokenizer, i)
        )
        for i in range(len(tokenizer))
    ]


def _unescape_byte_pieces(tokenizer: Any, token_id: int) -> bytes:
    return _SP_BYTE_PIECE.sub(_hex_byte, tokenizer.convert_ids_to_tokens(token_id).encode())


def _hex_byte(match: re.Match[bytes]) -> bytes:
    return bytes.fromhex(match[1].decode())


def _sp_piece_bytes(coded: bytes) -> bytes:
    # Applied to special tokens too, as genlm-backend does.
    return coded.replace(_SP_SPACE, b" ")


def check_byte_decoder(tokenizer: Any, byte_decoder: dict[str, int]) -> None:
    """Check that ``byte_decoder`` covers every character and round-trips a hard string.

    Raises:
        ByteDecoderError: a character of the vocabulary is missing or the probe string does
            not come back intact.
    """
    _check_byte_decoder_has_all_bytes(tokenizer, byte_decoder)
    _check_complex_roundtrip(tokenizer, byte_decoder)


def _check_byte_decoder_has_all_bytes(tokenizer: Any, byte_decoder: dict[str, int]) -> None:
    special = tokenizer.get_added_vocab().keys()
    used = {c for piece in tokenizer.get_vocab() if piece not in special for c in piece}
    missing = used - byte_decoder.keys()
    if missing:
        raise ByteDecoderError(f"Byte decoder is missing bytes: {missing}")


def _check_complex_roundtrip(tokenizer: Any, byte_decoder: dict[str, int]) -> None:
    probe = _ROUNDTRIP_PROBE
    try:
        reconstructed = _reencode(tokenizer, byte_decoder, probe)
    except Exception as e:
        raise ByteDecoderError(
            f"The tokenizer being used is unable to convert a special character in {probe}."
        ) from e
    try:
        decoded = reconstructed.decode()
    except UnicodeDecodeError as e:
        raise ByteDecoderError(f"Failed to reconstruct the string {probe}: {e}") from e
    if decoded != probe:
        raise ByteDecoderError(
            f"Failed to reconstruct the string {probe} from the tokenizer's byte_decoder: "
            f"{decoded!r} != {probe!r}"
        )


def _reencode(tokenizer: Any, byte_decoder: dict[str, int], text: str) -> bytes:
    """``text`` tokenized, then each piece mapped back to bytes; a leading BOS is dropped."""
    input_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = (tokenizer.convert_ids_to_tokens(i) for i in input_ids)
    reconstructed = b"".join(bytes(byte_decoder[c] for c in piece) for piece in pieces)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and reconstructed.startswith(bos.encode()):
        reconstructed = reconstructed[len(bos) :]
    return reconstructed


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest are shifted
    past U+0100 so that every byte has a visible, whitespace-free character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = (b for b in range(256) if b not in printable)
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return mapping


def default_byte_decoder() -> dict[str, int]:
    """Character -> byte for the GPT-2 alphabet, plus raw whitespace and ``▁`` as space."""
    decoder = {ch: b for b, ch in _bytes_to_unicode().items()}
    decoder.update(_EXTRA_BYTE_CHARS)
    return decoder
