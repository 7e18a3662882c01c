"""Vocabularies and token-character tries, with genlm-backend 0.3.1's behaviour.

Laid out like ``genlm.backend.tokenization`` and ``genlm.backend.trie``, imports going one way:
``token`` (``Token``) and ``bytes`` (a tokenizer's token bytes) stand alone, ``vocab``
(``decode_vocab``, ``Vocabularies``) builds on both; ``trie`` is the numpy trie;
``trie_parallel`` (torch) builds on ``trie``; ``trie_async`` (auto-batching) on both.
"""

from producer.tokenization.trie import TokenCharacterTrie
from producer.tokenization.trie_async import AsyncTokenCharacterTrie
from producer.tokenization.trie_parallel import ParallelTokenCharacterTrie
from producer.tokenization.vocab import Token, Vocabularies, decode_vocab

__all__ = [
    "AsyncTokenCharacterTrie",
    "ParallelTokenCharacterTrie",
    "Token",
    "TokenCharacterTrie",
    "Vocabularies",
    "decode_vocab",
]
