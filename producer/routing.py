"""Which shard a request goes to: prompts that share a prefix share a shard (and a worker).

The shard is a hash of the caller's affinity key when given (an SMC run id, say), else of the
prompt's first ``affinity_tokens`` token ids. Prompts shorter than that hash whole, so their
shard changes as they grow: callers with short, growing prompts should pass an affinity key.
"""

from __future__ import annotations

import hashlib

from shared.protocol import ID_BYTES


def shard_of(ids: bytes, shards: int, affinity_tokens: int, affinity: str | None = None) -> int:
    """Shard of a prompt given as packed int32 ids (its wire form)."""
    if shards <= 1:
        return 0
    data = (
        b"k" + affinity.encode()
        if affinity is not None
        else b"t" + ids[: ID_BYTES * affinity_tokens]
    )
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") % shards
