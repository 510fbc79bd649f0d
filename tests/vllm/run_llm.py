"""One vLLM engine run in its own process (vLLM starts its workers with spawn; a fresh process
is a fresh prefix cache): `python run_llm.py '<json>'` prints one JSON line.

Input: model (folder), dtype (float32 unless given), prompts (token id lists), max_tokens,
connector (kv_connector_extra_config, or null for a run without the store), role (kv_both /
kv_producer / kv_consumer), kv_events (a ZMQ endpoint: vLLM publishes its KV events there,
topic "kv"), dump_kv (also write every layer's paged KV, with its layout, to this .pt file),
inprocess (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the test can reach the connector; false runs
vLLM's engine-core and worker processes as users do).
Output: tokens (greedy, per prompt), cached_tokens (per prompt: tokens not computed),
stats (the connector's counters, in-process runs only), namespace, shared_memory (whether
its data calls went through the daemon's shared memory), prefill_steps (forward steps the
workers timed that reached the scheduler side's cost model, in-process runs only), groups
(the KV-cache groups the worker's connector registered: more than one when vLLM's hybrid
manager is on, None when it registered none, in-process runs only).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main() -> None:
    args: dict[str, Any] = json.loads(sys.argv[1])
    if args.get("inprocess", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if args.get("connector") is not None:
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_role=args.get("role", "kv_both"),
            kv_connector_extra_config=args["connector"],
        )
    events = None
    if args.get("kv_events"):
        from vllm.config import KVEventsConfig

        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                endpoint=args["kv_events"], topic="kv")
    llm = LLM(model=args["model"], skip_tokenizer_init=True, dtype=args.get("dtype", "float32"),
              max_model_len=args.get("max_model_len", 2048), enforce_eager=True, seed=0,
              kv_cache_memory_bytes=args.get("kv_cache_bytes", 64 << 20),
              max_num_batched_tokens=args.get("max_num_batched_tokens", 2048),
              kv_transfer_config=transfer, kv_events_config=events)
    params = SamplingParams(max_tokens=args.get("max_tokens", 8), temperature=0.0,
                            ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result: dict[str, Any] = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "cached_tokens": [o.num_cached_tokens for o in outputs],
    }
    if transfer is not None and args.get("inprocess", True):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        connector.link.flush(30.0)
        result["stats"] = connector.link.stats.as_dict()
        result["namespace"] = connector.namespace
        result["shared_memory"] = connector.link.client.uses_shared_memory
        # None: vLLM registered no layout (a model the connector stores nothing for)
        result["groups"] = connector.paged.num_groups if connector.paged is not None else None
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
        result["prefill_steps"] = scheduler.connector.scheduler.prefill.steps
        result["group_names"] = scheduler.connector.scheduler._group_names
        result["group_bytes"] = connector.worker.loaded_group_bytes
        result["group_block_bytes"] = [p.block_bytes for p in connector.worker.group_paged]
    if args.get("dump_kv"):
        import torch
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        paged = get_kv_transfer_group().paged
        torch.save({"num_blocks": paged.num_blocks, "layout": paged.layout,
                    "layers": {n: t.clone() for n, t in zip(paged.names, paged.tensors,
                                                            strict=True)}}, args["dump_kv"])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
