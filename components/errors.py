"""The one exception type for problems with what the user asked for."""

import contextlib
import contextvars
import os

# Where a relative path is read from, as messages name it: a run's recipe reads every path (but extends) from the
# directory the run starts in; a command reading paths given on its own command line names its own words.
_RELATIVE_TO = contextvars.ContextVar("relative_to", default="the directory the run starts in")


class UserError(Exception):
    """Bad input (a path, a file, a value): the message names the problem and the fix.

    The engine prints the message alone (no traceback) and exits non-zero, so the message
    must stand on its own: what is wrong, where, and what to do instead.
    """


def first_line(error: BaseException) -> str:
    """The first line of an exception's text ('' when it has none): for a one-line message naming a library's
    error, whose full text may span many lines."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def raised(error: BaseException) -> str:
    """What a part's exception was, for a one-line message: 'Type: first line', or for a sys.exit, that call (its
    text alone is the exit code, or nothing)."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({'' if error.code is None else repr(error.code)})"
    return f"{type(error).__name__}: {first_line(error)}"


def read_from(path: str) -> str:
    """'' for an absolute path; for a relative one, where it was read from: every path in a recipe but extends is
    relative to the directory the run starts in (not the recipe's folder), which a message must say to be fixed."""
    if os.path.isabs(os.path.expanduser(path)):
        return ""
    return f" (relative to {_RELATIVE_TO.get()}, {os.getcwd()})"


@contextlib.contextmanager
def relative_paths_read_from(words: str):
    """Within it, read_from names the folder relative paths are read from by `words` (eval: "the current folder")."""
    token = _RELATIVE_TO.set(words)
    try:
        yield
    finally:
        _RELATIVE_TO.reset(token)
