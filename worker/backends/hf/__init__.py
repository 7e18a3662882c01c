"""The hf backend: transformers' models in this process (:mod:`.backend`), with a token-trie
key/value cache (:mod:`.kv_cache` over :mod:`.kv_trie`) and grouped-query attention that reads
key/value heads in place on the CPU (:mod:`.attention`)."""

from worker.backends.hf.backend import HFBackend, quantization_kwargs

__all__ = ["HFBackend", "quantization_kwargs"]
