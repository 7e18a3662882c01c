"""The model metadata: one description of a model, which the pool's entry extends."""

from __future__ import annotations

import typing

from shared.registry import ModelDescription, ModelMeta
from worker.backends.mock import MockBackend


def test_a_backend_describes_its_model_with_every_field() -> None:
    info = MockBackend(300).info
    assert set(info) == set(typing.get_type_hints(ModelDescription))


def test_model_meta_adds_only_pool_wide_fields() -> None:
    added = set(typing.get_type_hints(ModelMeta)) - set(typing.get_type_hints(ModelDescription))
    assert added == {
        "backend",
        "max_queue",
        "shards",
        "result_ttl_s",
        "affinity_tokens",
        "prompt_limit",
        "max_message_bytes",
        "wire_dtype",
        "protocol",
    }
