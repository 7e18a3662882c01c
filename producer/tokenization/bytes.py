"""The bytes of every token of a Hugging Face tokenizer, as genlm-backend 0.3.1 decodes them.

The decoding depends on how the tokenizer encodes bytes:

* byte-level BPE (GPT-2, SmolLM2, Llama 3...): every byte is drawn as a printable character
  of the GPT-2 alphabet, so token strings are mapped back through that alphabet;
* SentencePiece (Llama 2, Gemma...): ``▁`` stands for a space and ``<0xNN>`` pieces are raw
  byte fallbacks.

Special (added) tokens are never mapped through an alphabet; their text is UTF-8 encoded.
Several ids may decode to the same bytes (``<0x20>`` and ``▁`` are both a space); they stay
distinct tokens, told apart by ``token_id``.

The tokenizer's pieces and added tokens are read once, in one call each (:class:`Decoded`
keeps the pieces for the string vocabulary); only the decoder's JSON is read to tell the
encoding, not the whole tokenizer's; pieces are mapped to bytes with ``str.translate``.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

__all__ = [
    "ByteDecoderError",
    "ByteVocabError",
    "Decoded",
    "check_byte_decoder",
    "decode_bytes",
    "default_byte_decoder",
    "get_byte_tokens_from_byte_decoder",
    "get_byte_tokens_from_sp",
    "get_byte_vocab",
]

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


class ByteDecoderError(Exception):
    """A byte decoder cannot map some token of the tokenizer back to its bytes."""


class ByteVocabError(Exception):
    """The byte encoding of a tokenizer's vocabulary cannot be determined."""


class Decoded(NamedTuple):
    """A tokenizer's token bytes and the pieces read to get them (the string vocabulary
    falls back on the pieces)."""

    raw: list[bytes]
    """The bytes of every token, by id."""
    pieces: list[Any]
    """``tokenizer.convert_ids_to_tokens(i)`` of every id."""

    def piece(self, token_id: int) -> Any:
        return self.pieces[token_id]


class _Reader:
    """What the decoding reads from a tokenizer, each read at most once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pieces: list[Any] | None = None
        self._special: dict[int, str] | None = None

    @property
    def pieces(self) -> list[Any]:
        if self._pieces is None:
            self._pieces = list(
                self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            )
        return self._pieces

    @property
    def special(self) -> dict[int, str]:
        """Added tokens by id: their text is literal, not in the model's byte encoding."""
        if self._special is None:
            added = self.tokenizer.get_added_vocab()
            self._special = {token_id: text for text, token_id in added.items()}
        return self._special


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
    return decode_bytes(tokenizer).raw


def decode_bytes(tokenizer: Any) -> Decoded:
    """:func:`get_byte_vocab`, and the pieces it read."""
    reader = _Reader(tokenizer)
    kinds = _decoder_kinds(tokenizer)
    if kinds & _SENTENCEPIECE_DECODERS:
        raw = _sp_bytes(reader)
    elif _BYTE_LEVEL_DECODER in kinds:
        raw = _byte_level_vocab(
            reader,
            default_byte_decoder(),
            "Tokenizer declares a ByteLevel decoder but does not round-trip under "
            "the GPT-2 byte alphabet.",
        )
    elif kinds:
        raise ByteVocabError(
            f"Cannot determine the byte encoding of {tokenizer.name_or_path!r}: its "
            f"decoder is {sorted(kinds)}, which is neither ByteLevel nor SentencePiece."
        )
    elif hasattr(tokenizer, "sp_model"):
        raw = _sp_bytes(reader)
    else:
        raw = _byte_level_vocab(
            reader,
            getattr(tokenizer, "byte_decoder", None) or default_byte_decoder(),
            f"Tokenizer {tokenizer.name_or_path!r} exposes no decoder to inspect and "
            "does not round-trip under the GPT-2 byte alphabet.",
        )
    return Decoded(raw, reader.pieces)


def _byte_level_vocab(reader: _Reader, byte_decoder: dict[str, int], error: str) -> list[bytes]:
    """Byte vocabulary through ``byte_decoder``, once it is shown to round-trip."""
    try:
        _check_byte_decoder(reader, byte_decoder)
    except ByteDecoderError as e:
        raise ByteVocabError(error) from e
    return _bytes_from_byte_decoder(reader, byte_decoder)


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """Type names of every component of the backend decoder; empty without a backend.

    Reads the decoder's own serialization, not the whole tokenizer's (megabytes).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = backend.decoder
        tree = None if decoder is None else json.loads(decoder.__getstate__())
    except Exception:  # a backend without the pickling support of ``tokenizers``
        tree = json.loads(backend.to_str()).get("decoder")
    kinds: set[str] = set()
    _collect_types(tree, kinds)
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


def get_byte_tokens_from_byte_decoder(tokenizer: Any, byte_decoder: dict[str, int]) -> list[bytes]:
    """Bytes of every token by mapping each character of its piece through ``byte_decoder``."""
    return _bytes_from_byte_decoder(_Reader(tokenizer), byte_decoder)


def _bytes_from_byte_decoder(reader: _Reader, byte_decoder: dict[str, int]) -> list[bytes]:
    special, pieces = reader.special, reader.pieces
    table = _translation(byte_decoder)
    if table is not None:
        try:
            chars = set("".join(p for i, p in enumerate(pieces) if i not in special))
        except TypeError:  # a piece that is not a string: the loop below says which
            chars = None
        if chars is not None and chars <= byte_decoder.keys():
            # Every character maps to one byte, spelled as the latin-1 character of that byte.
            return [
                special[i].encode() if i in special else p.translate(table).encode("latin-1")
                for i, p in enumerate(pieces)
            ]
    return [
        special[i].encode() if i in special else bytes(byte_decoder[c] for c in pieces[i])
        for i in range(len(pieces))
    ]


def _translation(byte_decoder: dict[str, int]) -> dict[int, str] | None:
    """``str.translate`` table from each character to the latin-1 character of its byte; None
    when some entry is not one character to one byte."""
    table = {}
    for char, byte in byte_decoder.items():
        if not (isinstance(char, str) and len(char) == 1 and type(byte) is int and 0 <= byte < 256):
            return None
        table[ord(char)] = chr(byte)
    return table


def get_byte_tokens_from_sp(tokenizer: Any) -> list[bytes]:
    """Bytes of every SentencePiece piece: ``<0xNN>`` is byte NN, ``▁`` is a space."""
    return _sp_bytes(_Reader(tokenizer))


def _sp_bytes(reader: _Reader) -> list[bytes]:
    special, pieces = reader.special, reader.pieces
    return [
        _sp_piece_bytes(special[i].encode() if i in special else _unescape_byte_pieces(pieces[i]))
        for i in range(len(pieces))
    ]


def _unescape_byte_pieces(piece: str) -> bytes:
    coded = piece.encode()
    return _SP_BYTE_PIECE.sub(_hex_byte, coded) if b"<0x" in coded else coded


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
    _check_byte_decoder(_Reader(tokenizer), byte_decoder)


def _check_byte_decoder(reader: _Reader, byte_decoder: dict[str, int]) -> None:
    _check_byte_decoder_has_all_bytes(reader, byte_decoder)
    _check_complex_roundtrip(reader.tokenizer, byte_decoder)


def _check_byte_decoder_has_all_bytes(reader: _Reader, byte_decoder: dict[str, int]) -> None:
    special = set(reader.special.values())
    used = set("".join(piece for piece in reader.tokenizer.get_vocab() if piece not in special))
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
