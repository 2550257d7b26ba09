"""Tiny model configurations shared by the model tests (no tests here)."""

from __future__ import annotations

from components.models import NSAArgs, TransformerArgs

VOCAB = 61


def small_nsa(**nsa_overrides) -> NSAArgs:
    """Small l/d/l'/n/w so that every branch matters within a few dozen tokens."""
    values = dict(block_size=4, block_stride=2, sel_block_size=8, num_selected=2, window_size=5)
    values.update(nsa_overrides)
    return NSAArgs(**values)


def tiny_args(attention: str = "nsa", *, nsa: NSAArgs | None = None, **overrides) -> TransformerArgs:
    values = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64, attention=attention)
    values.update(overrides)
    if attention == "nsa":
        values["nsa"] = nsa if nsa is not None else small_nsa()
    return TransformerArgs(**values)
