"""The public surface of genlm-backend 0.3.1's ``AsyncLM``, ``AsyncTransformer`` and
``AsyncVirtualLM``: each public name's kind (sync, async, property, classmethod) and parameters.

``AsyncVirtualLM`` is a placeholder without methods unless vLLM is installed (it is not here),
so its surface is read from the source of ``genlm/backend/llm/vllm.py`` with ``ast`` (the real
class is inspected when vLLM is present). A member's parameters exclude ``self`` / ``cls``.
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLASSES = ("AsyncLM", "AsyncTransformer", "AsyncVirtualLM")
CONTEXT_DUNDERS = ("__enter__", "__exit__", "__aenter__", "__aexit__")
"""Dunders that are part of the surface (``AsyncVirtualLM`` is a context manager)."""
EMPTY = "<no default>"


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    """``inspect.Parameter`` kind name, e.g. ``POSITIONAL_OR_KEYWORD``."""
    default: Any = EMPTY

    def __str__(self) -> str:
        star = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(self.kind, "")
        default = "" if self.default == EMPTY else f"={self.default!r}"
        kw = " (keyword-only)" if self.kind == "KEYWORD_ONLY" else ""
        return f"{star}{self.name}{default}{kw}"


@dataclass(frozen=True)
class Member:
    kind: str
    """``sync``, ``async``, ``property`` or ``classmethod``."""
    params: tuple[Param, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(map(str, self.params))})"


def is_public(name: str) -> bool:
    return not name.startswith("_") or name in CONTEXT_DUNDERS


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine: ``inspect.iscoroutinefunction`` of the function
    under its decorators (genlm-backend wraps ``AsyncTransformer.next_token_logprobs`` in
    ``torch.no_grad()``, whose wrapper is a plain function returning the coroutine)."""
    return inspect.iscoroutinefunction(inspect.unwrap(fn))


def member_of(cls: type, name: str) -> Member:
    """Kind and parameters of ``cls.name`` (``AttributeError`` if it has none)."""
    attr = inspect.getattr_static(cls, name)
    if isinstance(attr, property):
        return Member("property")
    if isinstance(attr, classmethod):
        return Member("classmethod", _params(attr.__func__))
    if isinstance(attr, staticmethod):
        return Member("staticmethod", _params(attr.__func__, bound=False))
    if not callable(attr):
        return Member("attribute")
    return Member("async" if is_async(attr) else "sync", _params(attr))


def surface_of(cls: type) -> dict[str, Member]:
    """Every public member defined in ``cls`` or a base other than ``object``."""
    names = {n for klass in cls.__mro__ if klass is not object for n in vars(klass) if is_public(n)}
    return {n: member_of(cls, n) for n in sorted(names)}


def _params(fn: Any, bound: bool = True) -> tuple[Param, ...]:
    fn = inspect.unwrap(fn)
    params = list(inspect.signature(fn).parameters.values())
    if bound:
        params = params[1:]
    return tuple(
        Param(p.name, p.kind.name, EMPTY if p.default is inspect.Parameter.empty else p.default)
        for p in params
    )


@functools.cache
def genlm_surfaces() -> dict[str, dict[str, Member]]:
    """``{class name: {public name: Member}}`` of genlm-backend's three classes."""
    from genlm.backend import llm

    out = {
        "AsyncLM": surface_of(llm.AsyncLM),
        "AsyncTransformer": surface_of(llm.AsyncTransformer),
    }
    vlm = llm.AsyncVirtualLM
    if issubclass(vlm, llm.AsyncLM):  # the real class: vLLM is installed
        out["AsyncVirtualLM"] = surface_of(vlm)
    else:
        own = _virtual_lm_from_source(Path(inspect.getfile(llm.AsyncTransformer)).parent)
        out["AsyncVirtualLM"] = {**out["AsyncLM"], **own}
    return out


def _virtual_lm_from_source(llm_dir: Path) -> dict[str, Member]:
    """The members ``AsyncVirtualLM`` itself defines, from its source (the class that derives
    from ``AsyncLM``, not the placeholder defined when vLLM is missing)."""
    tree = ast.parse((llm_dir / "vllm.py").read_text())
    classes = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and node.name == "AsyncVirtualLM"
        and any(isinstance(b, ast.Name) and b.id == "AsyncLM" for b in node.bases)
    ]
    assert len(classes) == 1, "genlm-backend's vllm.py no longer defines AsyncVirtualLM(AsyncLM)"
    members: dict[str, Member] = {}
    for node in classes[0].body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not is_public(node.name):
            continue
        decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
        if "property" in decorators:
            members[node.name] = Member("property")
            continue
        if "classmethod" in decorators:
            kind = "classmethod"
        else:
            kind = "async" if isinstance(node, ast.AsyncFunctionDef) else "sync"
        members[node.name] = Member(kind, _ast_params(node.args))
    return members


def _ast_params(args: ast.arguments) -> tuple[Param, ...]:
    positional = [*args.posonlyargs, *args.args][1:]  # without self / cls
    defaults = [EMPTY] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    params = [
        Param(a.arg, "POSITIONAL_ONLY" if a in args.posonlyargs else "POSITIONAL_OR_KEYWORD", d)
        for a, d in zip(positional, defaults, strict=True)
    ]
    if args.vararg is not None:
        params.append(Param(args.vararg.arg, "VAR_POSITIONAL"))
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(Param(a.arg, "KEYWORD_ONLY", EMPTY if d is None else ast.literal_eval(d)))
    if args.kwarg is not None:
        params.append(Param(args.kwarg.arg, "VAR_KEYWORD"))
    return tuple(params)


def all_public_names() -> list[str]:
    """The union of the three classes' public names, sorted."""
    return sorted({n for s in genlm_surfaces().values() for n in s})


def defined_in(name: str) -> list[str]:
    return [c for c in CLASSES if name in genlm_surfaces()[c]]
