"""The registry as a test found it, given back afterwards: a test's plugin parts do not outlive it."""

from __future__ import annotations

import contextlib

from nsa_titan import registry


@contextlib.contextmanager
def registry_restored():
    registry.ensure_builtins()
    saved = {kind: dict(parts) for kind, parts in registry._PARTS.items()}
    try:
        yield
    finally:
        registry._PARTS.clear()
        registry._PARTS.update(saved)
