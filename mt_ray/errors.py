"""Typed errors raised at the boundaries of mt-ray.

Each one says what was wrong and what to do about it, so a user never has to read a
traceback from deep inside torch or transformers to find the cause.
"""


class MtRayError(Exception):
    """Base class for every error mt-ray raises on purpose."""


class ConfigError(MtRayError, ValueError):
    """A configuration key or value is wrong; the message names the dotted key."""


class DatasetError(MtRayError, ValueError):
    """A dataset entry, file or row cannot be used; the message names the file and row."""


class ModelNotSupportedError(MtRayError, ValueError):
    """The model's structure is not one the streaming engine can train."""


class CheckpointError(MtRayError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupted."""


class InsufficientMemoryError(MtRayError, MemoryError):
    """The training state (or a batch) cannot fit in the memory that is available."""
