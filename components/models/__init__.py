"""Transformer language models with NSA or dense attention."""

from components.models.args import NSAArgs, TransformerArgs, find_problems
from components.models.flops import flops_per_token
from components.models.generate import generate
from components.models.hooks import transformer_hooks
from components.models.kv_cache import KVCache
from components.models.telemetry import collect_nsa_telemetry
from components.models.transformer import Transformer, TransformerBlock, build_transformer

__all__ = [
    "NSAArgs",
    "TransformerArgs",
    "Transformer",
    "TransformerBlock",
    "KVCache",
    "build_transformer",
    "find_problems",
    "flops_per_token",
    "generate",
    "collect_nsa_telemetry",
    "transformer_hooks",
]
