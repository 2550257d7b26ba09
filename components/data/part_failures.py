"""What a data part (a source's documents(), a tokenizer's encode() or decode(), a plugin's most often) raises, as one
message naming the part, what it was doing and the line in its file: it was a traceback from deep in the loader or a
command. Errors that are already the user's message, and memory running out, stay what they are."""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from typing import Iterator

from components.errors import UserError, raised


@contextlib.contextmanager
def failures_named(part, kind: str, doing: str, fix: str) -> Iterator[None]:
    """Inside: an exception becomes "the KIND (Type) failed DOING: Error: text (FILE, line N). Fix: FIX"."""
    try:
        yield
    except (UserError, MemoryError):
        raise
    except (Exception, SystemExit) as exc:  # a plugin's sys.exit ended the command in silence
        raise UserError(f"the {kind} ({type(part).__name__}) failed {doing}: {raised(exc)}"
                        f"{raised_at(exc, part)}. Fix: {fix}") from None


def raised_at(exc: Exception, part) -> str:
    """' (FILE, line N)' where `exc` was raised: the deepest line in `part`'s own file, else the deepest of all but
    the wrappers' (this package's modules that call the part)."""
    try:
        own = inspect.getsourcefile(type(part))
    except TypeError:  # a built-in or C type
        own = None
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if f.filename == own] or [f for f in frames if f.filename not in _WRAPPERS]
    return f" ({inside[-1].filename}, line {inside[-1].lineno})" if inside else ""


# The files whose frames lie above every part's call, never the place a part failed.
_WRAPPERS = frozenset([contextlib.__file__] + [os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
                                                for name in ("part_failures.py", "dataset.py", "tokenizer_calls.py")])
