"""Typed exceptions for everything a caller can cause.

Internal invariants use ``assert``; these are raised for bad input, bad checkpoints and bad configuration.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class CheckpointError(EngineError):
    """The model directory is missing, incomplete or inconsistent."""


class UnsupportedArchitectureError(CheckpointError):
    """config.json names an architecture the engine has no model code for."""


class InvalidRequestError(EngineError, ValueError):
    """A request cannot be served as given (empty prompt, too long, unknown id...)."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or inconsistent."""


class ConfigError(EngineError, ValueError):
    """An engine or method configuration value is unknown or out of range."""


class OutOfPagesError(EngineError):
    """The page pool cannot hold even a single request of this size."""
