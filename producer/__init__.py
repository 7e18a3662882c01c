"""Producer side of lmpool: ``RemoteLM``, a drop-in for genlm-backend's ``AsyncLM``."""

from producer.remote_lm import RemoteLM

__all__ = ["RemoteLM"]
