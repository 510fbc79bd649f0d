"""The engine's front door: `LLM(model_path).generate(prompts, SamplingParams(...))`. Loads a
checkpoint (Hugging Face folder or GGUF), sizes the paged KV cache, and drives the scheduler
and the model runner step by step until every request has finished. Everything a request
could get wrong is checked before the first step runs.

With a store, each step first collects the lookups and loads that came back (deciding, for
each hit, how much of it to load), then starts the ones the scheduler planned, and runs the
batch without waiting for them; only a step with nothing to compute waits, for the next one
to come back. Every forward pass is timed into the prefill model the decision uses."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import count

import torch

from kvstore.client import TLS
from kvstore.engine.block_manager import BlockManager
from kvstore.engine.connector import Looked, StoreConnector
from kvstore.engine.errors import EngineError, InvalidRequestError
from kvstore.engine.loader import load_checkpoint
from kvstore.engine.model import CausalLM
from kvstore.engine.outputs import Prompt, RequestOutput, build_output, stop_index
from kvstore.engine.runner import ModelRunner, kv_cache_shape
from kvstore.engine.sampling import SamplingParams
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.engine.sequence import Sequence as Seq
from kvstore.integrations.codecs import CodecError, namespace_suffix
from kvstore.integrations.cost import PrefillModel
from kvstore.kernels import ops_for
from kvstore.units import parse_size

logger = logging.getLogger("kvstore.engine")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    """Tokens per KV block (and per store key)."""
    kv_cache_size: str | int = "1GiB"
    """Memory for the paged KV cache; num_blocks, when set, wins."""
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    """Default: the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    """"swap" writes a preempted sequence's blocks to the store and loads them on resume
    (needs `store`); "recompute" drops them."""
    store: str | None = None
    """A kvstore daemon (host:port; a bare host means port 50051): look prompts up there,
    load hits, offload full blocks."""
    store_timeout_s: float = 2.0
    """Longest one store call may take (calls run beside the steps); past it the store is off
    until it answers again, and what it did not deliver is computed."""
    store_load_policy: str = "auto"
    """"auto": load a store hit only when that is expected to be faster than computing it
    (per tier, from measured rates); "always"; "never" (look up, but compute)."""
    store_token: str | None = field(default=None, repr=False)
    """The store's bearer token (auth.mode=token); None: KVSTORE_TOKEN or KVSTORE_TOKEN_FILE."""
    store_tls: TLS | bool | None = None
    """TLS to the store (kvstore.client.TLS; True: the system roots); None: KVSTORE_TLS_*."""
    store_unix_socket: str | None = None
    """The store's Unix socket as mounted here (shared memory with auth on); None:
    KVSTORE_UNIX_SOCKET, else the path the daemon reports."""
    store_codec: str = "none"
    """How blocks are stored (docs/codecs.md): "none" (the raw K/V, outputs token-exact),
    "fp8" (e4m3 with a power-of-two scale per token and head: about half of bfloat16's bytes)
    or "int4" (KIVI-style, keys per channel and values per token: under a third). The lossy
    codecs change outputs slightly; the codec is part of the namespace, so blocks stored
    with one never load into an engine using another."""
    prewarm_bytes: int | None = None
    """At start, pull this namespace's hottest L4 blocks into the daemon (0: its default);
    None: no pre-warm."""
    attention_sinks: int = 0
    """Keep the first this many tokens attendable beside a sliding-window model's window
    (StreamingLLM's attention sinks), for streaming generation past max_position_embeddings
    with bounded KV blocks: an approximation that changes outputs (the model was not trained
    to attend that way; positions past its context length are unseen RoPE angles). With it,
    max_model_len may exceed max_position_embeddings. Needs a model with a sliding window."""
    dtype: str = "auto"
    """auto: float32 on CPU; on CUDA the checkpoint's dtype, bfloat16 for a float32 one."""
    device: str = "auto"
    """auto: cuda when torch sees a GPU, else cpu."""


@dataclass
class StepInfo:
    """What on_step callbacks get after every engine step (progress displays)."""

    finished_requests: int
    total_requests: int
    generated_tokens: int
    batched_tokens: int
    running: int
    waiting: int


@dataclass
class _Request:
    request_id: int
    prompt: Prompt
    params: SamplingParams
    arrival_s: float
    seqs: list[Seq] = field(default_factory=list)


@dataclass
class _Stepped:
    finished: list[RequestOutput] = field(default_factory=list)
    generated: int = 0
    batched_tokens: int = 0


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequestError(f"device {name!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r}: torch sees no CUDA device here")
    return device


def _pick_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if checkpoint_dtype == "float32" else _DTYPES[checkpoint_dtype]
    if name not in _DTYPES:
        raise InvalidRequestError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


class LLM:
    def __init__(self, model_path: str, config: EngineConfig | None = None, **overrides: object):
        config = replace(config or EngineConfig(), **overrides)  # type: ignore[arg-type]
        checkpoint = load_checkpoint(model_path)
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, checkpoint.config.torch_dtype, self.device)
        mc = checkpoint.config
        sinks = config.attention_sinks
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise InvalidRequestError(f"attention_sinks must be an int >= 0, got {sinks!r}")
        if sinks and not mc.layer_windows:
            raise InvalidRequestError(
                f"attention_sinks={sinks} needs a model with a sliding window; this one "
                "attends to its whole context in every layer")
        max_model_len = config.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings and not sinks:
            raise InvalidRequestError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings ({mc.max_position_embeddings}); only "
                "attention_sinks (streaming past the context length) allows that"
            )
        if config.block_size < 1:
            raise InvalidRequestError(f"block_size must be positive, got {config.block_size}")
        self.config = replace(config, max_model_len=max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
        )
        if config.preemption_mode == "swap" and config.store is None:
            raise InvalidRequestError('preemption_mode "swap" needs a store (set store=host:port)')
        try:
            codec_suffix = namespace_suffix(config.store_codec)
        except CodecError as exc:
            raise InvalidRequestError(str(exc)) from None
        if codec_suffix and config.store is None:
            raise InvalidRequestError(
                f"store_codec {config.store_codec!r} needs a store (set store=host:port)")
        if config.store is not None and not config.enable_prefix_caching:
            raise InvalidRequestError(
                "store needs enable_prefix_caching: loaded blocks join the prefix cache and "
                "offloads follow its keys")
        model = CausalLM.from_weights(
            mc,
            checkpoint.weights,
            dtype=self.dtype,
            device=self.device,
            max_positions=max_model_len,
        )
        model.set_attention_sinks(sinks)
        num_blocks = config.num_blocks or self._blocks_for(model, config)
        self.namespace = (
            f"{checkpoint.name}|{mc.architecture}-{mc.num_layers}L-{mc.num_kv_heads}x"
            f"{mc.head_dim}-{str(self.dtype).removeprefix('torch.')}-bs{config.block_size}"
        )
        if sinks:
            # Sinks change every K/V past the window in the layers above the first: such
            # blocks must never meet those of the plain model, locally or in the store.
            self.namespace += f"-sinks{sinks}"
        # A lossy codec changes the stored bytes (and the K/V loaded back): its blocks live in
        # a namespace of their own. "none" adds nothing, so raw blocks stored before still hit.
        self.namespace += codec_suffix
        # Blocks that slid out of the window are released only when every layer has the same
        # window: a full-attention layer (or a wider window) still reads them.
        self.block_manager = BlockManager(
            num_blocks, config.block_size, self.namespace, config.enable_prefix_caching,
            window=mc.uniform_window, sinks=sinks,
        )
        self.runner = ModelRunner(
            model, ops_for(self.device), num_blocks, config.block_size, self.dtype, self.device
        )
        self.prefill = PrefillModel()
        """Seconds per forward step from what it computed: the load-or-recompute rule's
        compute side."""
        self.connector: StoreConnector | None = None
        if config.store is not None:
            self.connector = StoreConnector(
                config.store, self.namespace, self.runner.kv_cache, config.block_size,
                self.runner.ops, timeout_s=config.store_timeout_s, token=config.store_token,
                tls=config.store_tls, unix_socket=config.store_unix_socket,
                load_policy=config.store_load_policy, prefill=self.prefill,
                step_tokens=config.max_num_batched_tokens, codec=config.store_codec,
            )
            if config.prewarm_bytes is not None:
                self.connector.prewarm(config.prewarm_bytes)
        self.scheduler = Scheduler(
            scheduler_config, self.block_manager, config.block_size, mc.eos_token_ids,
            store=self.connector is not None,
        )
        self._ids = count()
        self._requests: dict[int, _Request] = {}  # unfinished, by request id

    def _blocks_for(self, model: CausalLM, config: EngineConfig) -> int:
        shape = kv_cache_shape(model, 1, config.block_size)
        block_bytes = torch.Size(shape).numel() * torch.finfo(self.dtype).bits // 8
        num_blocks = parse_size(config.kv_cache_size) // block_bytes
        if num_blocks < 1:
            raise InvalidRequestError(
                f"kv_cache_size {config.kv_cache_size!r} holds no block of {block_bytes} bytes"
            )
        return int(num_blocks)

    # -- requests -------------------------------------------------------------------------
    def _to_ids(self, index: int, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    f"prompts[{index}] is text but this checkpoint has no tokenizer; pass token ids"
                )
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"prompts[{index}] holds {token!r}; token ids are integers in [0, {vocab})"
                )
        return ids

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in prompt order.
        Every prompt is checked before any starts."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        now = time.perf_counter()
        requests = [self._request(index, prompt, p, now)
                    for index, (prompt, p) in enumerate(zip(batch, params, strict=True))]
        for request in requests:
            self._admit(request)
        done: dict[int, RequestOutput] = {}
        generated = 0
        try:
            while len(done) < len(requests):
                out = self._step()
                done.update((o.request_id, o) for o in out.finished)
                generated += out.generated
                if on_step is not None:
                    on_step(StepInfo(sum(r.request_id in done for r in requests),
                                     len(requests), generated, out.batched_tokens,
                                     len(self.scheduler.running), len(self.scheduler.waiting)))
        except BaseException:  # a failed callback (or Ctrl-C): these requests end here
            left = [r for r in requests if self._requests.pop(r.request_id, None) is not None]
            self._abort(left)
            raise
        return [done[r.request_id] for r in requests]

    # -- one step at a time (a server's loop) -----------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue one request (checked now); it joins the batch from the next `step`. Returns
        its request id, which its RequestOutput carries."""
        request = self._request(0, prompt, params or SamplingParams(), time.perf_counter())
        self._admit(request)
        return request.request_id

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        return self._step().finished

    def _request(self, index: int, prompt: Prompt, params: SamplingParams,
                 arrival_s: float) -> _Request:
        ids = self._to_ids(index, prompt)
        try:
            self.scheduler.check(len(ids), params.max_tokens)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"prompts[{index}]: {exc}") from None
        request = _Request(next(self._ids), prompt, params, arrival_s)
        request.seqs.append(Seq(next(self._ids), request.request_id, ids, params))
        return request

    def _admit(self, request: _Request) -> None:
        self._requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])

    def _step(self) -> _Stepped:
        try:
            return self._step_once()
        except BaseException:
            # A failed step (or Ctrl-C) must not leave sequences holding blocks for the next
            # call to trip over: every request in flight ends.
            self._abort(list(self._requests.values()))
            self._requests.clear()
            raise

    def _step_once(self) -> _Stepped:
        """One scheduler step: the store's answers in, a forward pass, the outputs out."""
        connector = self.connector
        if connector is not None:
            self._collect(connector)
            self.scheduler.store_up = connector.available
        out = self.scheduler.schedule()
        if connector is not None:
            self._start_store_work(connector, out)
        if out.is_empty:
            if connector is not None and self.scheduler.waiting_on_store:
                # Nothing to compute until a lookup or a load comes back: wait for it.
                self._collect(connector, wait_s=self.config.store_timeout_s)
                return _Stepped()
            raise EngineError("the scheduler made no progress (KV cache too small?)")
        if connector is not None:
            for run in out.swapped_out:  # before this step's forward pass reuses them
                connector.swap_out(run.keys, run.block_ids)
        chunks = [(item.num_new_tokens, item.seq.num_computed_tokens) for item in out.scheduled]
        start = time.perf_counter()
        sampled = self.runner.execute(out)
        now = time.perf_counter()
        self.prefill.observe(chunks, now - start)
        stepped, finished = self.scheduler.update(out, sampled, lambda: next(self._ids))
        if connector is not None:
            for run in out.filled:
                connector.offload(run.keys, run.block_ids, run.parent)
        self._record_tokens(stepped, finished, now)
        for seq in finished:
            self.runner.forget(seq.seq_id)
        result = _Stepped(generated=len(stepped), batched_tokens=out.num_batched_tokens)
        result.finished.extend(self._finished_outputs(finished))
        return result

    @staticmethod
    def _start_store_work(connector: StoreConnector, out: SchedulerOutput) -> None:
        """Start the lookups and loads the scheduler asked for (they run on loader threads)."""
        for lookup in out.lookups:
            connector.start_lookup(lookup)
        for load in out.loads:
            answer = load.seq.store_answer
            connector.start_load(load, answer.tier if answer else "")

    def _record_tokens(self, stepped: list[Seq], finished: list[Seq],
                       now: float) -> None:
        """Note the step's tokens on their sequences; a sequence that hit a stop string ends
        (and joins finished)."""
        for seq in stepped:
            request = self._requests[seq.request_id]
            if seq.child_index and seq not in request.seqs:
                request.seqs.append(seq)
            seq.first_token_s = seq.first_token_s or now
            seq.last_token_s = now
            if seq.params.stop and not seq.is_finished and self._hit_stop(seq):
                self.scheduler.finish(seq, "stop")
                finished.append(seq)

    def _finished_outputs(self, finished: list[Seq]) -> list[RequestOutput]:
        """The outputs of the requests whose every sequence has finished; they are forgotten."""
        outputs = []
        for request_id in {seq.request_id for seq in finished}:
            request = self._requests[request_id]
            if len(request.seqs) == request.params.n and all(s.is_finished
                                                             for s in request.seqs):
                del self._requests[request_id]
                outputs.append(build_output(request_id, request.prompt, request.seqs,
                                            request.arrival_s, self.tokenizer))
        return outputs

    def _collect(self, connector: StoreConnector, wait_s: float = 0.0) -> None:
        """Hand the lookups and loads that came back to the scheduler, deciding for each hit
        how much of it to load; wait_s > 0: wait that long at most for the first."""
        for event in connector.poll(wait_s):
            if isinstance(event, Looked):
                self.scheduler.lookup_done(event.plan.seq, connector.decide(event))
            else:
                # the bytes those blocks took from the store (block_bytes: one block's)
                self.scheduler.load_done(event.plan.seq, event.arrived,
                                         event.arrived * connector.block_bytes)

    def reset_prefix_cache(self) -> int:
        """Drop the engine's own cached blocks (as if they had been evicted); the store keeps
        its copies. Returns the blocks dropped."""
        return int(self.block_manager.reset_prefix_cache())

    def close(self) -> None:
        """Finish pending offloads and disconnect from the store."""
        if self.connector is not None:
            self.connector.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _abort(self, requests: list[_Request]) -> None:
        connector = self.connector
        # Loads write into blocks their sequences hold: let them land before the blocks go
        # (one still out past the deadline keeps its blocks: never reused while written).
        deadline = time.monotonic() + 2 * self.config.store_timeout_s + 1.0
        try:
            while (connector is not None and self.scheduler.waiting_on_store
                   and time.monotonic() < deadline):
                self._collect(connector, wait_s=0.1)
        except Exception:  # the abort goes on: what failed first is already being raised
            logger.exception("kvstore: collecting the store's answers during an abort failed")
        for request in requests:
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                self.runner.forget(seq.seq_id)

    def _hit_stop(self, seq: Seq) -> bool:
        """Whether a stop string ends in the newest tokens: only a tail long enough to hold
        the longest stop string (a token is at least one character, plus slack for a
        character split across byte tokens) is decoded, not the whole output each step."""
        if self.tokenizer is None:
            return False
        window = max(len(s) for s in seq.params.stop) + 4
        text = self.tokenizer.decode(seq.output_token_ids[-window:])
        return stop_index(text, seq.params.stop) is not None


def _as_prompt_list(prompts: object) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise InvalidRequestError(
            f"prompts must be a string, a list of token ids, or a list of those; "
            f"got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise InvalidRequestError("prompts is empty")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    out: list[Prompt] = []
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list, tuple)):
            raise InvalidRequestError(
                f"prompts[{index}] must be a string or a list of token ids, "
                f"got {type(prompt).__name__}"
            )
        out.append(prompt if isinstance(prompt, str) else list(prompt))
    return out


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, size: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * size
    if isinstance(params, SamplingParams):
        return [params] * size
    listed = list(params)
    if len(listed) != size:
        raise InvalidRequestError(
            f"sampling_params has {len(listed)} entries for {size} prompts; give one or one each"
        )
    for index, p in enumerate(listed):
        if not isinstance(p, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params[{index}] must be SamplingParams, got {type(p).__name__}"
            )
    return listed
