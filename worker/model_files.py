"""The bundled default model and model paths, for what runs beside the worker (the Makefile,
the demo, tests and benchmarks). The backends own the model files' code
(:mod:`worker.backends.model_files`); this module names what the rest reads of it."""

from worker.backends.model_files import converted_gguf, default_model_path, resolve_model

__all__ = ["converted_gguf", "default_model_path", "resolve_model"]
