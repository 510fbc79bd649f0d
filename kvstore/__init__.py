"""kvstore: a multi-tier KV-cache store for LLM inference (daemon core)."""

__version__ = "0.1.0"
