"""Vocabulary entries: :class:`Token` (genlm-backend 0.3.1's ``Token``, reimplemented), and
genlm-backend's own class when it is installed (:func:`genlm_token_class`).

genlm-control checks ``isinstance(t, genlm.backend.tokenization.Token)``, so ``RemoteLM``
hands out genlm-backend's class when it can; ours, with the same constructor and behaviour,
serves everywhere else. :func:`make_tokens` builds a whole vocabulary of either.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Token", "genlm_token_class", "make_tokens"]


class Token(bytes):
    """One vocabulary entry: the bytes it decodes to, and its id.

    It is ``bytes`` so that ``b"".join(tokens)``, ``len``, slicing and ``.decode()`` work
    unchanged, but two tokens compare and hash by ``token_id``: distinct ids may share their
    bytes and must stay distinct in sets, dict keys and tries. A token compared with plain
    ``bytes`` falls back to comparing content. Ordering between tokens is by id.
    """

    token_id: int

    def __new__(cls, token_id: int, byte_string: bytes) -> Token:
        if not isinstance(token_id, int):
            raise TypeError(f"token_id must be an int, got {type(token_id)}")
        if not isinstance(byte_string, bytes):
            raise TypeError(f"byte_string must be bytes, got {type(byte_string)}")
        obj = super().__new__(cls, byte_string)
        obj.token_id = token_id
        return obj

    @property
    def byte_string(self) -> bytes:
        """The token's bytes as a plain ``bytes`` object."""
        return bytes(self)

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id}, byte_string={bytes(self)!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id != other.token_id
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.token_id)

    def __lt__(self, other: bytes) -> bool:
        if not isinstance(other, Token):
            return NotImplemented
        return self.token_id < other.token_id

    def __le__(self, other: bytes) -> bool:
        if not isinstance(other, Token):
            return NotImplemented
        return self.token_id <= other.token_id

    def __gt__(self, other: bytes) -> bool:
        if not isinstance(other, Token):
            return NotImplemented
        return self.token_id > other.token_id

    def __ge__(self, other: bytes) -> bool:
        if not isinstance(other, Token):
            return NotImplemented
        return self.token_id >= other.token_id

    @staticmethod
    def as_bytes(x: Any) -> Any:
        """The bytes of a token; anything else is returned unchanged."""
        return x.byte_string if isinstance(x, Token) else x

    @staticmethod
    def is_plain_bytes(x: object) -> bool:
        """Whether ``x`` is ``bytes`` but not a :class:`Token`."""
        return isinstance(x, bytes) and not isinstance(x, Token)

    def __reduce__(self) -> tuple[type[Token], tuple[int, bytes]]:
        # bytes pickles by content only; the id must travel too.
        return (Token, (self.token_id, bytes(self)))


def make_tokens(raw: Sequence[bytes], token_class: Any = Token) -> list[Any]:
    """``[token_class(i, raw[i]) ...]``, with the garbage collector paused.

    Each token is a new object with a ``__dict__``; in a process that holds torch's and
    transformers' millions of objects, the collections that tens of thousands of new objects
    trigger cost several times the construction itself (0.3 s against 0.05 s for 49,152).
    """
    with _gc_paused():
        return [token_class(i, b) for i, b in enumerate(raw)]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_GENLM_TOKEN_MODULE = "genlm.backend.tokenization.token"
_genlm_lock = threading.Lock()


def genlm_token_class() -> type[bytes] | None:
    """genlm-backend's ``Token`` class when genlm-backend is installed, else None.

    genlm-control checks ``isinstance(t, genlm.backend.tokenization.Token)``, so a vocabulary
    it walks must be made of that class. Importing ``genlm.backend`` costs about a second (its
    package imports its LLM engines); when nothing has imported it yet, only the module that
    defines ``Token`` (pure Python, no imports) is loaded, under its own name, so that
    ``genlm.backend`` finds it there when it is imported later and uses the same class.
    """
    module = sys.modules.get(_GENLM_TOKEN_MODULE)
    if module is None:
        with _genlm_lock:
            module = sys.modules.get(_GENLM_TOKEN_MODULE) or _load_genlm_token_module()
    token = getattr(module, "Token", None)
    return token if isinstance(token, type) and issubclass(token, bytes) else None


def _load_genlm_token_module() -> Any:
    if "genlm.backend" in sys.modules:  # imported, or being imported: the regular way
        try:
            return importlib.import_module(_GENLM_TOKEN_MODULE)
        except Exception:  # its optional dependencies may fail: ours will do
            return None
    try:
        backend = importlib.util.find_spec("genlm.backend")  # imports no more than ``genlm``
    except (ImportError, ValueError):
        return None
    if backend is None or not backend.submodule_search_locations:
        return None
    for folder in backend.submodule_search_locations:
        path = Path(folder) / "tokenization" / "token.py"
        if not path.is_file():
            continue
        spec = importlib.util.spec_from_file_location(_GENLM_TOKEN_MODULE, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        sys.modules[_GENLM_TOKEN_MODULE] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            del sys.modules[_GENLM_TOKEN_MODULE]
            return None
        sys.meta_path.insert(0, _LinkTokenModule())
        return module
    return None


class _LinkTokenModule(importlib.abc.MetaPathFinder):
    """Once ``genlm.backend.tokenization`` is imported, give it the attribute ``token`` that
    the import system sets only on a submodule it loads itself (``from ... import`` works
    without it, ``genlm.backend.tokenization.token.Token`` would not)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _GENLM_TOKEN_MODULE.rsplit(".", 1)[0]:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if _GENLM_TOKEN_MODULE in sys.modules:
                module.token = sys.modules[_GENLM_TOKEN_MODULE]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
