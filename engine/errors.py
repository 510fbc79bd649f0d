"""Typed errors of the engine: each names the problem (the file, field or value) and is raised
before any work starts."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model path that is missing or malformed: no config, a broken JSON, a missing tensor,
    a tensor of the wrong shape. The message names the file and the field or tensor."""


class UnsupportedModelError(ModelLoadError):
    """A well-formed checkpoint of an architecture or feature the engine does not implement."""


class InvalidRequestError(EngineError, ValueError):
    """A prompt or sampling value the engine cannot serve; the message names the field."""
