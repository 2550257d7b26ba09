"""Options of the commands themselves (not recipe fields), taken out of argv before the recipe is read."""

from __future__ import annotations

from components.errors import UserError


def take_option(argv: list[str], name: str, default: str | None = None) -> str | None:
    """Remove `NAME VALUE` or `NAME=VALUE` from argv and return VALUE (default when absent)."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise UserError(f"{name} needs a value. Fix: write {name}=VALUE.")
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(name + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return default
