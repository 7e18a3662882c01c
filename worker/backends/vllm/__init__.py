"""The vllm backend: vLLM's engine stepped by the worker (:mod:`.backend`), started and watched
(:mod:`.engine`), works as engine requests (:mod:`.works`), full-vocabulary rows captured where
the model runs (:mod:`.capture`) and fetched from there (:mod:`.rows`), settings mapped to engine
arguments (:mod:`.engine_args`, LoRA checks in :mod:`.lora`). Importing this package does not
import vLLM."""

from worker.backends.vllm.backend import VLLMBackend

__all__ = ["VLLMBackend"]
