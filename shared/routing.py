"""Which shard a request goes to: prompts that share a prefix share a shard (and a worker).

The shard is a hash of the caller's affinity key when given (an SMC run id, say), else of the
prompt's first ``affinity_tokens`` token ids. Prompts shorter than that hash whole, so their
shard changes as they grow: callers with short, growing prompts should pass an affinity key.
"""

from __future__ import annotations

import hashlib
import struct


def shard_of(ids: list[int], shards: int, affinity_tokens: int, affinity: str | None = None) -> int:
    if shards <= 1:
        return 0
    if affinity is not None:
        data = b"k" + affinity.encode()
    else:
        head = ids[:affinity_tokens]
        data = b"t" + struct.pack(f"<{len(head)}q", *head)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") % shards
