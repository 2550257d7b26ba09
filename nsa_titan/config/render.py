"""Write a typed Recipe back as the nested table its TOML would hold."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from nsa_titan.config.toml_io import dumps


def recipe_text(recipe) -> tuple[str, str]:
    """The resolved recipe's TOML, as a run writes it, and its hash (the recipe's identity in checkpoints)."""
    text = dumps(recipe_to_table(recipe))
    return text, hashlib.sha256(text.encode()).hexdigest()[:12]


def recipe_to_table(obj: Any) -> dict:
    """Every field, defaults included, in recipe order; parts' arguments where the TOML puts them."""
    table: dict[str, Any] = {}
    fields = {fld.name: fld for fld in dataclasses.fields(obj)}
    for fld in fields.values():
        value = getattr(obj, fld.name)
        if "args_for" in fld.metadata:
            if value is None:
                continue
            args = recipe_to_table(value)
            if fld.metadata.get("placement") == "inline":
                table.update(args)
            else:
                table[getattr(obj, fld.metadata["args_for"])] = args
        elif dataclasses.is_dataclass(value):
            table[fld.name] = recipe_to_table(value)
        elif isinstance(value, dict):  # named tables
            table[fld.name] = {name: recipe_to_table(entry) for name, entry in value.items()}
        else:
            table[fld.name] = list(value) if isinstance(value, (list, tuple)) else value
    return table
