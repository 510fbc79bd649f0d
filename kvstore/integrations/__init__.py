"""Engines' connectors to the store: `link` (the store-facing half every connector shares),
`paged` (gather and scatter of blocks in an engine's paged KV tensors), `settings` (a vLLM
connector's options and namespace, checked without vLLM) and `vllm` (vLLM's
`KVConnectorBase_V1`, imported only by vLLM: it needs vLLM installed)."""
