"""How pdserve refuses a model directory: every model config parser raises ModelConfigError."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """The model directory is not one pdserve can serve; the message says what is wrong."""
