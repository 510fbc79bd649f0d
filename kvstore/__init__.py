"""kvstore: a multi-tier KV-cache store for LLM inference.

The top-level modules (keys, units, shm, tier, extents) are what every part may import: the
daemon (`kvstore.core`, `kvstore.daemon`), the tools, the client, the engine and the tiers.
"""

__version__ = "0.1.0"
