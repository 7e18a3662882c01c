"""What a scoring run computes for every line: the mode and its settings, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from producer.inputs import sample_params
from shared.errors import InvalidRequest

Key: TypeAlias = int | str
"""A line's ``id``: its own, or its 1-based line number."""
MODES = ("logprobs", "sample", "score")
DEFAULT_CONCURRENCY = 256
DEFAULT_SHARD_ROWS = 1024
DEFAULT_MAX_TOKENS = 32


@dataclass(frozen=True)
class ScoreOptions:
    """What to compute for every line (the CLI flags; the arq job's arguments map onto them)."""

    mode: str = "logprobs"
    top_k: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    seed: int | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    shard_rows: int = DEFAULT_SHARD_ROWS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.top_k is not None and (self.mode != "logprobs" or self.top_k < 1):
            raise ValueError("top_k needs mode 'logprobs' and must be >= 1")
        if self.max_tokens < 1 or self.concurrency < 1 or self.shard_rows < 1:
            raise ValueError("max_tokens, concurrency and shard_rows must be >= 1")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")
        try:  # the limits every request is held to, checked once (not failing every line)
            sample_params(self.max_tokens, [], self.temperature, self.seed)
        except InvalidRequest as e:
            raise ValueError(str(e)) from None

    @property
    def full_vectors(self) -> bool:
        """Whole next-token distributions, stored in ``.npy`` shards."""
        return self.mode == "logprobs" and self.top_k is None

    @property
    def decisive(self) -> dict[str, object]:
        """The settings that decide a line's result (a resumed output must keep them)."""
        out: dict[str, object] = {"mode": self.mode, "top_k": self.top_k}
        if self.mode == "sample":
            out.update(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed)
        return out

    @property
    def signature(self) -> str:
        """The field every output line of this mode has (checked when resuming)."""
        if self.full_vectors:
            return "shard"
        return {"logprobs": "top_ids", "sample": "tokens", "score": "logprobs"}[self.mode]
