"""Tokenizers that travel through Redis: serialize on the worker, rebuild on the producer.

A producer host has no model files: workers publish ``tokenizer.json`` (the fast tokenizer's
own serialization) and the special-token settings, and the producer rebuilds a
``PreTrainedTokenizerFast`` from them. genlm-control reads ``tokenizer._tokenizer.model.merges``,
which survives this round trip.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def tokenizer_config(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The settings beyond ``tokenizer.json`` that a rebuilt tokenizer needs."""
    config: dict[str, Any] = {
        k: str(getattr(tokenizer, k)) for k in SPECIAL_KEYS if getattr(tokenizer, k, None)
    }
    config["name_or_path"] = tokenizer.name_or_path
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        config["chat_template"] = template
    config["model_max_length"] = min(int(tokenizer.model_max_length), 1 << 31)
    return config


def tokenizer_from_json(
    tokenizer_json: str, config: dict[str, Any], **options: Any
) -> PreTrainedTokenizerFast:
    """Rebuild the worker's tokenizer from what it published (``options``: more keyword
    arguments of ``PreTrainedTokenizerFast``, such as ``add_bos_token``).

    The JSON is parsed once, from a temporary file: ``tokenizer_object=`` would parse it, then
    deep-copy the result (serialize and parse again), twice the cost (SmolLM2's 49,152 tokens
    and merges: about 0.15 s this way, 0.35 s that way).
    """
    kwargs = {k: config[k] for k in SPECIAL_KEYS if k in config}
    with tempfile.TemporaryDirectory(prefix="lmpool-tokenizer-") as folder:
        path = os.path.join(folder, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(tokenizer_json)
        tok = PreTrainedTokenizerFast(
            tokenizer_file=path,
            model_max_length=config.get("model_max_length", 1 << 31),
            **kwargs,
            **options,
        )
    tok.name_or_path = config.get("name_or_path", "")
    if "chat_template" in config:
        tok.chat_template = config["chat_template"]
    return tok


def byte_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges: one token per byte, then extra tokens.

    Token ``i < 256`` is byte ``i``; the ids from 256 up are ``<|extra_i|>`` and the last id is
    ``<|endoftext|>``. With fewer than 257 ids only the first bytes exist. Used by the mock
    backend so that the whole producer side (vocabularies, tries) works without a model.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_of)
    vocab: dict[str, int] = {}
    for i in range(min(vocab_size - 1, 256)):
        vocab[byte_chars[i]] = i
    for i in range(len(vocab), vocab_size - 1):
        vocab[f"<|extra_{i}|>"] = i
    vocab["<|endoftext|>"] = vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in vocab if t.startswith("<|")]
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.name_or_path = f"mock-{vocab_size}"
    return fast


def _byte_of(char: str) -> int:
    return _BYTE_OF[char]


def _gpt2_byte_map() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_OF = _gpt2_byte_map()

__all__ = ["byte_tokenizer", "tokenizer_config", "tokenizer_from_json"]
