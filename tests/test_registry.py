"""The model metadata's two spellings agree: the backend's dataclass and the published map."""

from __future__ import annotations

import dataclasses
import typing

from shared.registry import ModelDescription, ModelMeta
from worker.backends.base import ModelInfo


def test_model_info_fields_are_the_published_description() -> None:
    described = typing.get_type_hints(ModelDescription)
    info = typing.get_type_hints(ModelInfo)
    assert info == described
    assert [f.name for f in dataclasses.fields(ModelInfo)] == list(described)


def test_model_meta_adds_only_pool_wide_fields() -> None:
    added = set(typing.get_type_hints(ModelMeta)) - set(typing.get_type_hints(ModelDescription))
    assert added == {
        "backend",
        "max_queue",
        "shards",
        "affinity_tokens",
        "prompt_limit",
        "max_message_bytes",
        "wire_dtype",
        "protocol",
    }
