"""Shared, cached captures of the tiny zoo models for the backend tests (no tests here; capture is slow)."""

from __future__ import annotations

import functools

from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model

SEQ = 8


@functools.cache
def captured(name: str):
    """(module, inputs, captured graph) of a tiny zoo model at [1, SEQ]."""
    loaded = load_model(name)
    inputs = example_inputs(loaded, seq=SEQ)
    module = loaded.logits_module()
    return module, inputs, capture(module, inputs, name=name)
