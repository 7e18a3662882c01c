"""The byte and string vocabularies of a Hugging Face tokenizer, as genlm-backend 0.3.1's
``decode_vocab`` builds them.

genlm-control walks a language model's ``byte_vocab`` to build character tries and to map
sampled bytes back to token ids, so a remote LM must hand out exactly the list genlm-backend's
``decode_vocab`` would: one :class:`Token` per vocabulary index, carrying the raw bytes the
token stands for (decoded by ``producer.tokenization.bytes``).

Same results as genlm-backend, at a fraction of the cost (SmolLM2, 49,152 tokens: 0.65 s ->
about 0.15 s): the tokenizer is read once for both vocabularies, and tokens are built with
the garbage collector paused (``make_tokens``). :class:`Vocabularies` builds each vocabulary
on first use, in the class it will be handed out in (``RemoteLM`` hands out genlm-backend's
``Token``, see ``genlm_token_class``). The byte decoding's and the token module's public
names are re-exported here, where they used to live.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

from producer.tokenization.bytes import (
    ByteDecoderError,
    ByteVocabError,
    Decoded,
    decode_bytes,
    get_byte_vocab,
)
from producer.tokenization.token import Token, genlm_token_class, make_tokens

__all__ = [
    "ByteDecoderError",
    "ByteVocabError",
    "Token",
    "Vocabularies",
    "bytes_to_strs",
    "decode_vocab",
    "genlm_token_class",
    "get_byte_vocab",
    "make_tokens",
]

Byte2StrFallback = Literal["tokenizer", "latin1", "replace"]
BYTE2STR_FALLBACKS: tuple[str, ...] = ("tokenizer", "latin1", "replace")


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
    vocabs = Vocabularies(tokenizer, Token, byte2str_fallback)
    return vocabs.byte_vocab, vocabs.str_vocab


class Vocabularies:
    """The byte and string vocabularies of one tokenizer, each built once, on first use.

    What :func:`decode_vocab` returns, split so that a caller who needs only one pays only for
    it, and the tokenizer's pieces are read once for both. ``token_class`` is the class of the
    byte vocabulary's entries: :class:`Token`, genlm-backend's ``Token`` (same constructor and
    behaviour), or None for genlm-backend's when it can be loaded, else ours
    (:func:`genlm_token_class`), resolved when the byte vocabulary is first built.
    Thread-safe: concurrent first uses build once.

    Raises (on first use of either vocabulary):
        ValueError: unknown fallback, or a tokenizer whose byte encoding cannot be decoded.
    """

    def __init__(
        self,
        tokenizer: Any,
        token_class: type[bytes] | None = None,
        byte2str_fallback: Byte2StrFallback | str = "tokenizer",
    ) -> None:
        if byte2str_fallback not in BYTE2STR_FALLBACKS:
            raise ValueError(f"Unknown byte2str_fallback strategy: {byte2str_fallback}")
        self.tokenizer = tokenizer
        self.token_class = token_class
        self.byte2str_fallback = byte2str_fallback
        self._lock = threading.RLock()
        self._decoded: Decoded | None = None
        self._byte_vocab: list[Any] | None = None
        self._str_vocab: list[str] | None = None

    @property
    def raw(self) -> list[bytes]:
        """The bytes of every token, by id, as plain ``bytes``."""
        return self._decode().raw

    @property
    def byte_vocab(self) -> list[Any]:
        """One ``token_class`` instance per token id (``Token(i, raw[i])``)."""
        if self._byte_vocab is None:
            with self._lock:
                if self._byte_vocab is None:
                    token_class = self.token_class or genlm_token_class() or Token
                    self._byte_vocab = make_tokens(self._decode().raw, token_class)
        return self._byte_vocab

    @property
    def str_vocab(self) -> list[str]:
        """The UTF-8 text of every token, by id; ``byte2str_fallback`` where it is invalid."""
        if self._str_vocab is None:
            with self._lock:
                if self._str_vocab is None:
                    decoded = self._decode()
                    self._str_vocab = _strs(decoded.raw, decoded.piece, self.byte2str_fallback)
        return self._str_vocab

    def _decode(self) -> Decoded:
        if self._decoded is None:
            with self._lock:
                if self._decoded is None:
                    try:
                        self._decoded = decode_bytes(self.tokenizer)
                    except ByteVocabError as e:
                        raise ValueError(
                            "Could not decode byte representation of token vocabuary from "
                            f"tokenizer {self.tokenizer.name_or_path}"
                        ) from e
        return self._decoded


def bytes_to_strs(
    tokenizer: Any, byte_vocab: Sequence[bytes], byte2str_fallback: Byte2StrFallback | str
) -> list[str]:
    """UTF-8 strings of ``byte_vocab``; invalid UTF-8 is rendered by ``byte2str_fallback``.

    Different ids may map to the same string; that is expected and not reported.
    """
    return _strs(byte_vocab, tokenizer.convert_ids_to_tokens, byte2str_fallback)


def _strs(byte_vocab: Sequence[bytes], piece: Callable[[int], Any], fallback: str) -> list[str]:
    """``bytes_to_strs`` with ``piece(i)`` the tokenizer's spelling of token ``i``."""
    out = []
    for token_id, raw in enumerate(byte_vocab):
        try:
            out.append(raw.decode("utf-8"))
            continue
        except UnicodeDecodeError:
            pass
        if fallback == "latin1":
            out.append(raw.decode("latin1"))  # every byte sequence is valid latin-1
        elif fallback == "replace":
            out.append(raw.decode("utf-8", errors="replace"))
        else:
            out.append(piece(token_id))
    return out
