"""The one exception type for problems with what the user asked for."""


class UserError(Exception):
    """Bad input (a path, a file, a value): the message names the problem and the fix.

    The engine prints the message alone (no traceback) and exits non-zero, so the message
    must stand on its own: what is wrong, where, and what to do instead.
    """
