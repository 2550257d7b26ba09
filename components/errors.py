"""The one exception type for problems with what the user asked for."""


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
