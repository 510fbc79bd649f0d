"""The vLLM connector's options (`kv_connector_extra_config`), its namespace and each request's
chain root, worked out without importing vLLM (its objects are read by attribute) so that a bad
value fails at start naming its key, and so all of it is tested anywhere.

    {"target": "10.0.0.5:50051", "namespace_prefix": "team-a/", "token_file": "/run/kv/token",
     "shared_memory": "auto", "offload": true, "timeout_s": 1.0, "load_policy": "auto"}

Credentials: `token` or `token_file`, else the client's own variables (KVSTORE_TOKEN,
KVSTORE_TOKEN_FILE); `tls_ca_file` / `tls_cert_file` / `tls_key_file` / `tls_server_name`, else
KVSTORE_TLS_*. The namespace names everything a stored block's bytes depend on, so that two
engines that could not use each other's blocks never share one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.client import TLS
from kvstore.client.credentials import read_token_file
from kvstore.client.errors import KVStoreError
from kvstore.integrations.codecs import CODECS, namespace_suffix
from kvstore.integrations.cost import POLICIES
from kvstore.keys import MAX_NAMESPACE_BYTES, BlockKey, namespace_root

ENV_TARGET = "KVSTORE_TARGET"
DEFAULT_TARGET = "127.0.0.1:50051"
_FIELD = "kv_connector_extra_config"


class SettingsError(ValueError):
    """A bad option; the message names the key."""


@dataclass(frozen=True)
class Settings:
    target: str = DEFAULT_TARGET
    """The daemon, HOST:PORT (default: env KVSTORE_TARGET, else 127.0.0.1:50051)."""
    namespace_prefix: str = ""
    """Put in front of every namespace: the prefix a tenant owns (`team-a/`)."""
    namespace_salt: str = ""
    """Anything else the blocks depend on that the config does not show (a fine-tune's id, a
    weights checksum for a local folder reused under one path)."""
    token: str | None = None
    tls: TLS | None = None
    unix_socket: str | None = None
    shared_memory: bool | None = None
    """None ("auto"): read through the daemon's shared memory when co-located; False never;
    True requires it."""
    load: bool = True
    """Load hits from the store (off: only offload)."""
    offload: bool = True
    """Save newly full blocks to the store (off: only load)."""
    timeout_s: float = 1.0
    """One store call at most; past it the connector turns off and recomputes."""
    reconnect_s: float = 1.0
    """How often a turned-off connector probes the store."""
    max_pending_batches: int = 64
    """Offload batches queued at most; past it new ones are dropped (a future miss)."""
    load_policy: str = "auto"
    """How much of a hit to load: "auto" the leading blocks whose load is estimated to beat
    computing them (vLLM's own step times against this link's load rates, per tier);
    "always" the whole hit; "never" none (the hit is looked up and counted, then computed)."""
    codec: str = "none"
    """How blocks are stored (docs/codecs.md): "none" the raw K/V (token-exact); "fp8" or
    "int4" encoded by the worker before a put and decoded after a get (lossy, two to six
    times fewer bytes). Part of the namespace: blocks of one codec never meet another's."""


_KEYS = ("target", "namespace_prefix", "namespace_salt", "token", "token_file", "tls_ca_file",
         "tls_cert_file", "tls_key_file", "tls_server_name", "unix_socket", "shared_memory",
         "load", "offload", "timeout_s", "reconnect_s", "max_pending_batches",
         "load_policy", "codec")


def _str(extra: Mapping[str, Any], key: str, default: str | None) -> str | None:
    value = extra.get(key, default)
    if value is not None and (not isinstance(value, str) or (key != "namespace_prefix"
                                                             and key != "namespace_salt"
                                                             and not value)):
        raise SettingsError(f"{_FIELD}.{key} must be a non-empty string, got {value!r}")
    return value


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise SettingsError(f"{_FIELD}.{key} must be true or false, got {value!r}")
    return value


def _positive(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SettingsError(f"{_FIELD}.{key} must be a positive number, got {value!r}")
    return float(value)


def parse_settings(extra: Mapping[str, Any] | None,
                   env: Mapping[str, str] = os.environ) -> Settings:
    """Read the connector's options from kv_connector_extra_config. The first bad or unknown
    option raises SettingsError, which names its key."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise SettingsError(f"{_FIELD}.{unknown[0]}: unknown option; known: {', '.join(_KEYS)}")
    target = _str(extra, "target", env.get(ENV_TARGET) or DEFAULT_TARGET)
    token = _str(extra, "token", None)
    token_file = _str(extra, "token_file", None)
    if token is not None and token_file is not None:
        raise SettingsError(f"{_FIELD}.token_file: give token or token_file, not both")
    if token_file is not None:
        try:
            token = read_token_file(token_file, f"{_FIELD}.token_file")
        except KVStoreError as exc:
            raise SettingsError(str(exc)) from None
    tls_fields = {name: _str(extra, f"tls_{name}", None)
                  for name in ("ca_file", "cert_file", "key_file", "server_name")}
    tls = TLS(**tls_fields) if any(v is not None for v in tls_fields.values()) else None
    shared = extra.get("shared_memory", "auto")
    if shared not in ("auto", True, False):
        raise SettingsError(f"{_FIELD}.shared_memory must be \"auto\", true or false, "
                            f"got {shared!r}")
    pending = extra.get("max_pending_batches", 64)
    if isinstance(pending, bool) or not isinstance(pending, int) or pending < 1:
        raise SettingsError(f"{_FIELD}.max_pending_batches must be a positive integer, "
                            f"got {pending!r}")
    policy = extra.get("load_policy", "auto")
    if policy not in POLICIES:
        raise SettingsError(f"{_FIELD}.load_policy must be one of "
                            f"{', '.join(map(repr, POLICIES))}, got {policy!r}")
    codec = extra.get("codec", "none")
    if codec not in CODECS:
        raise SettingsError(f"{_FIELD}.codec must be one of {', '.join(map(repr, CODECS))}, "
                            f"got {codec!r}")
    return Settings(
        target=str(target),
        namespace_prefix=_str(extra, "namespace_prefix", "") or "",
        namespace_salt=_str(extra, "namespace_salt", "") or "",
        token=token,
        tls=tls,
        unix_socket=_str(extra, "unix_socket", None),
        shared_memory=None if shared == "auto" else bool(shared),
        load=_bool(extra, "load", True),
        offload=_bool(extra, "offload", True),
        timeout_s=_positive(extra, "timeout_s", 1.0),
        reconnect_s=_positive(extra, "reconnect_s", 1.0),
        max_pending_batches=pending,
        load_policy=str(policy),
        codec=str(codec),
    )


@dataclass(frozen=True)
class ModelShape:
    """What a block's bytes depend on, read from the engine's config."""

    model: str
    revision: str | None
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_layout: str
    tp_rank: int = 0
    tp_size: int = 1
    latent: bool = False
    """Multi-head Latent Attention (DeepSeek V2/V3): the cache holds one latent vector per
    token, replicated on every tensor-parallel rank rather than split by KV head."""


def namespace_for(settings: Settings, shape: ModelShape) -> str:
    """The namespace of the blocks a connector saves and loads:
    prefix + vllm/<model>@<revision>/<dtype>/<layers>x<kv heads>x<head dim>/bs<n>/<layout>/
    tp<rank>of<size>[/<salt>]. An MLA model's latent cache is the same on every rank and for
    every tensor-parallel size, so its blocks are named `latent` in place of
    tp<rank>of<size>: one copy that every rank of any size loads. A lossy `codec` ends it as
    it ends the engine's (`codecs.namespace_suffix`: `-codec.fp8.v1`; `none` adds nothing, so
    raw blocks keep their namespace). When the model name would make it longer than the
    namespace limit, the name is replaced by its SHA-256, and the rest stays readable."""
    model = f"{shape.model}@{shape.revision or 'main'}"
    if settings.codec == "int4" and shape.latent:
        raise SettingsError(f"{_FIELD}.codec: int4 does not apply to a latent (MLA) cache, "
                            f"one vector per token with no K/V split (int4 quantises keys per "
                            f"channel and values per token); use fp8 or none")
    suffix = namespace_suffix(settings.codec, f"{_FIELD}.codec")

    def build(name: str) -> str:
        parts = [f"{settings.namespace_prefix}vllm", name, shape.kv_dtype,
                 f"{shape.num_layers}x{shape.num_kv_heads}x{shape.head_dim}",
                 f"bs{shape.block_size}", shape.kv_layout,
                 "latent" if shape.latent else f"tp{shape.tp_rank}of{shape.tp_size}"]
        if settings.namespace_salt:
            parts.append(settings.namespace_salt)
        return "/".join(parts) + suffix

    namespace = build(model)
    if len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        namespace = build(hashlib.sha256(model.encode()).hexdigest()[:32])
    if len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise SettingsError(f"{_FIELD}.namespace_prefix / namespace_salt: the namespace "
                            f"{namespace[:64]!r}... is over {MAX_NAMESPACE_BYTES} bytes")
    return namespace


def model_shape(vllm_config: Any, tp_rank: int) -> ModelShape:
    """What a block's bytes depend on, read from vLLM's config (a VllmConfig)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix(
        "torch.")
    layout = getattr(cc, "kv_cache_layout", None)
    return ModelShape(
        model=str(mc.model), revision=mc.revision, kv_dtype=kv_dtype,
        num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(), block_size=cc.block_size,
        kv_layout=str(getattr(layout, "name", layout) or "default"),
        tp_rank=tp_rank, tp_size=pc.tensor_parallel_size,
        latent=bool(getattr(mc, "use_mla", False)))


def chain_root(namespace: str, request: Any) -> BlockKey:
    """A chain's root: the namespace's, or one derived from what else the request's K/V depend
    on: its LoRA adapter, and vLLM's `cache_salt` (which keeps vLLM's own prefix cache apart
    per salt). Requests share store blocks only when all of these match."""
    root = namespace_root(namespace)
    lora = request.lora_request
    # An adapter by name and path (its id is a per-server number): a miss across servers that
    # keep one adapter at different paths, never a hit across two adapters of one name.
    extra = [f"lora:{lora.lora_name}:{lora.lora_path}" if lora is not None else "",
             f"cache_salt:{request.cache_salt}" if request.cache_salt else ""]
    if not any(extra):
        return root
    return BlockKey(hashlib.sha256(root + "\0".join(extra).encode()).digest())


def group_root(root: BlockKey, kind: str, window: int, layers: Sequence[int]) -> BlockKey:
    """The chain root of one KV-cache group of a model with several (vLLM's hybrid manager):
    derived from the request's root, the group's attention kind, its window (0 for full
    attention) and its layers' indices, so that no two groups (and no group and a model with
    one group) ever share a key. A model with one group keeps the request's root itself: its
    keys, and the blocks stored under them before groups existed, do not change."""
    name = f"group:{kind}:{window}:{','.join(map(str, layers))}"
    return BlockKey(hashlib.sha256(root + b"\0" + name.encode()).digest())


def cacheable(request: Any) -> bool:
    """Whether token ids alone name the request's K/V: not with images or audio (their
    placeholder tokens are the same for every image) or prompt embeddings."""
    return not request.mm_features and request.prompt_embeds is None
