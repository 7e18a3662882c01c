"""Method-for-method parity with genlm-backend 0.3.1's ``AsyncLM``, ``AsyncTransformer`` and
``AsyncVirtualLM``: every public name exists with the same kind (sync, async, property,
classmethod) and the same parameter names, kinds and defaults.

A name several classes define is checked against each; a subclass's override (e.g.
``AsyncTransformer.add_new_lora(lora_path, lora_name="lora_1")`` over ``AsyncLM``'s
``add_new_lora(lora_path, lora_name)``) is an accepted form of its base's member too.
Kinds are those of the functions under their decorators (``surface.is_async``).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from .surface import (
    CLASSES,
    Member,
    all_public_names,
    defined_in,
    genlm_surfaces,
    is_async,
    member_of,
)

# -- the documented exceptions, each with its reason -------------------------------------------
EXEMPT_MISSING = {
    "add_query": "AsyncTransformer's in-process auto-batcher (a query, an asyncio future and "
    "past key/values): the pool batches on its workers",
    "batch_evaluate_queries": "runs AsyncTransformer's in-process batch: the workers batch",
    "walk_cache": "walks AsyncTransformer's in-process token trie (cache nodes, past key/values): "
    "the pool's KV cache lives on the workers",
}
"""Public names of genlm-backend that ``RemoteLM`` need not have."""
EXEMPT_PARAMS = {
    "from_name": "genlm's load model files (AsyncTransformer: model_id, bitsandbytes_opts, "
    "hf_opts; AsyncVirtualLM: model_name, engine_opts); RemoteLM.from_name(model_name=None, "
    "redis_url=None, timeout_s=None, **kwargs) connects to a pool. The kind (classmethod) "
    "must still match",
    "__exit__": "called positionally by the interpreter (RemoteLM takes *exc)",
    "__aexit__": "called positionally by the interpreter (RemoteLM takes *exc)",
}
"""Names whose parameters may differ (their kind may not)."""
EXTRA_KEYWORDS = {
    "next_token_logprobs": {"affinity"},
    "batch_next_token_logprobs": {"affinity"},
    "cache_kv": {"affinity"},
}
"""Keyword-only parameters with a default that ``RemoteLM`` adds (routing a run's requests to
one worker's KV cache): every call written for genlm-backend binds the same way."""
NOT_CHECKED_HERE = {
    "__init__": "the constructor: RemoteLM is built by connect() / from_name(), never from a "
    "model and tokenizer",
    "underlying_model": "a property in both (checked here); RemoteLM's raises AttributeError: "
    "no model runs in the producer's process",
}

SUBJECT_CLASS = {"reference": "AsyncTransformer", "pool": "RemoteLM"}


def subject_class(subject: str) -> type:
    if subject == "reference":
        from genlm.backend.llm import AsyncTransformer

        return AsyncTransformer
    from producer import RemoteLM

    return RemoteLM


def genlm_kind(name: str) -> str:
    kinds = {genlm_surfaces()[c][name].kind for c in defined_in(name)}
    assert len(kinds) == 1, f"genlm-backend's classes disagree on the kind of {name}: {kinds}"
    return kinds.pop()


def missing(subject: str, name: str) -> bool:
    """True when the subject lacks ``name`` and may (skips the reference, passes an exemption);
    False when it has it."""
    cls = subject_class(subject)
    try:
        inspect.getattr_static(cls, name)
    except AttributeError:
        if subject == "reference":
            pytest.skip(
                f"reference: genlm-backend's AsyncTransformer lacks {name} "
                f"(defined by {', '.join(defined_in(name))})"
            )
        if name in EXEMPT_MISSING:
            return True
        raise AssertionError(
            f"RemoteLM lacks {name}, which genlm-backend's {', '.join(defined_in(name))} "
            f"define as {genlm_kind(name)}"
        ) from None
    return False


@pytest.mark.parametrize("name", all_public_names())
def test_same_kind(lm: Any, subject: str, name: str) -> None:
    """Sync stays sync, async stays async, on the object a program holds."""
    if missing(subject, name):
        return
    static = inspect.getattr_static(type(lm), name)
    if isinstance(static, property):
        kind = "property"
    elif isinstance(static, classmethod):
        kind = "classmethod"
    else:
        kind = "async" if is_async(getattr(lm, name)) else "sync"
    assert kind == genlm_kind(name), (
        f"{type(lm).__name__}.{name} is {kind}; genlm-backend's is {genlm_kind(name)}"
    )


def _accepted(cls_name: str, name: str) -> list[Member]:
    """``cls_name``'s member and the overrides of it among genlm-backend's subclasses."""
    surfaces = genlm_surfaces()
    out = [surfaces[cls_name][name]]
    if cls_name == "AsyncLM":
        out += [surfaces[c][name] for c in CLASSES[1:] if name in surfaces[c]]
    return out


@pytest.mark.parametrize(
    "cls_name, name",
    [(c, n) for c in CLASSES for n in genlm_surfaces()[c]],
    ids=[f"{c}.{n}" for c in CLASSES for n in genlm_surfaces()[c]],
)
def test_same_signature(subject: str, cls_name: str, name: str) -> None:
    """Same parameter names, kinds and defaults as genlm-backend's (exceptions listed above)."""
    if missing(subject, name):
        return
    actual = member_of(subject_class(subject), name)
    accepted = _accepted(cls_name, name)
    assert actual.kind in {m.kind for m in accepted}
    if name in EXEMPT_PARAMS:
        return
    extra = EXTRA_KEYWORDS.get(name, set()) if subject == "pool" else set()
    added = [p for p in actual.params if p.name in extra]
    assert all(p.kind == "KEYWORD_ONLY" and p.default is None for p in added)
    params = tuple(p for p in actual.params if p.name not in extra)
    assert params in {m.params for m in accepted}, (
        f"{SUBJECT_CLASS[subject]}.{name}{actual} differs from genlm-backend's "
        f"{cls_name}.{name}: {' or '.join(map(str, accepted))}"
    )
