"""Producer side of lmpool: ``RemoteLM``, a drop-in for genlm-backend's ``AsyncLM``.

The vocabulary and trie helpers genlm-control uses come along, so programs can import all
they need from here.
"""

from producer.remote_lm import RemoteLM
from producer.tokenization import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    Token,
    TokenCharacterTrie,
    decode_vocab,
)

__all__ = [
    "AsyncTokenCharacterTrie",
    "ParallelTokenCharacterTrie",
    "RemoteLM",
    "Token",
    "TokenCharacterTrie",
    "decode_vocab",
]
