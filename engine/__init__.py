"""The paged-attention inference engine (docs/engine.md): `LLM(model_path).generate(...)`."""

from kvstore.engine.errors import (
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)
from kvstore.engine.llm import LLM, EngineConfig, StepInfo
from kvstore.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvstore.engine.sampling import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepInfo",
    "UnsupportedModelError",
]
