"""Reading the input: one JSON object a line, turned into a request or a line error.

A line has ``ids`` (token ids) or ``text`` (tokenized with the pool's tokenizer), an optional
``id`` (a string or integer; default the 1-based line number), for ``--mode score`` a
``continuation`` (ids) or ``continuation_text``, for ``--mode sample`` an optional ``seed`` that
overrides ``--seed``. Blank lines are ignored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from producer.scoring.options import Key, ScoreOptions
from shared.errors import InvalidRequest, LMPoolError


@dataclass
class Item:
    """One input line, ready to request."""

    key: Key
    line: int
    prompt: list[int]
    continuation: list[int] | None = None
    seed: int | None = None


class InputError(LMPoolError):
    """The input cannot be read as a run needs it."""


class LineError(Exception):
    """An input line that cannot be requested; ``key`` names it in the errors file."""

    def __init__(self, key: Key, error: BaseException) -> None:
        super().__init__(str(error))
        self.key = key
        self.error = error


def check_input(path: str | os.PathLike[str]) -> None:
    """A run reads its input twice (its lines counted, then scored) and a resume reads it
    again: a pipe (``<(zcat ...)``, ``/dev/stdin``) would be read once and score nothing, a
    named one would block. ``InputError`` unless ``path`` is a regular file."""
    if not os.path.exists(path):
        raise InputError(f"no input file {os.fspath(path)!r}")
    if not os.path.isfile(path):
        raise InputError(
            f"the input {os.fspath(path)!r} is not a regular file (a pipe?): it is read more "
            "than once (counted, scored, and again on a resume); write it to a file first"
        )


def iter_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, raw line)`` for every non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield lineno, raw


def count_lines(path: str | os.PathLike[str]) -> int:
    return sum(1 for _ in iter_lines(path))


def line_key(obj: Any, lineno: int) -> Key:
    """The line's ``id``, or its line number."""
    if not isinstance(obj, dict) or "id" not in obj:
        return lineno
    key = obj["id"]
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise LineError(lineno, InvalidRequest(f"id must be a string or an integer, not {key!r}"))
    return key


def _token_ids(
    obj: dict[str, Any], ids_field: str, text_field: str, tokenizer: Any, special: bool = True
) -> list[int]:
    """The ids of ``ids_field``, or of ``text_field`` tokenized; ``special``: with the special
    tokens the tokenizer adds to a text of its own (a BOS), as to a prompt, not to a
    continuation (its scores would start with the BOS's)."""
    if ids_field in obj:
        ids = obj[ids_field]
        if not isinstance(ids, list):
            raise InvalidRequest(f"{ids_field!r} must be a list of token ids")
        return ids
    if text_field in obj:
        text = obj[text_field]
        if not isinstance(text, str):
            raise InvalidRequest(f"{text_field!r} must be a string")
        return list(tokenizer.encode(text, add_special_tokens=special))
    raise InvalidRequest(f"line has neither {ids_field!r} nor {text_field!r}")


def read_line(raw: bytes, lineno: int) -> tuple[Key, Any]:
    """``(key, parsed JSON)`` of one input line; ``LineError`` (named by the line number) when
    it is not JSON or its ``id`` is unusable."""
    try:
        obj = json.loads(raw.rstrip(b"\r\n"))  # a string cut short: "unterminated", not "\n"
    except ValueError as e:
        raise LineError(lineno, InvalidRequest(f"line {lineno} is not JSON: {e}")) from None
    return line_key(obj, lineno), obj


def make_item(obj: Any, key: Key, lineno: int, options: ScoreOptions, tokenizer: Any) -> Item:
    """The request of one parsed line; ``LineError`` when it has none."""
    try:
        if not isinstance(obj, dict):
            raise InvalidRequest(f"line {lineno} is not a JSON object")
        item = Item(key, lineno, _token_ids(obj, "ids", "text", tokenizer))
        if options.mode == "score":
            item.continuation = _token_ids(
                obj, "continuation", "continuation_text", tokenizer, special=False
            )
        if options.mode == "sample":
            seed = obj.get("seed", options.seed)
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                raise InvalidRequest(f"seed must be an integer, not {seed!r}")
            item.seed = seed
        return item
    except InvalidRequest as e:
        raise LineError(key, e) from None


def parse_line(raw: bytes, lineno: int, options: ScoreOptions, tokenizer: Any) -> Item:
    """The request of one input line; ``LineError`` when it has none."""
    key, obj = read_line(raw, lineno)
    return make_item(obj, key, lineno, options, tokenizer)
