"""nsa_titan: the training engine. It assembles the parts a recipe names and runs them."""

__version__ = "0.1.0"


INTERRUPTED_WHILE_STARTING = "error: interrupted while starting (nothing ran)."


def say_interrupted_while_starting() -> int:
    """A Ctrl-C while the command line's modules still import (seconds: they load torch): one line, as a
    Ctrl-C later gets, not the import's traceback. Returns the exit code a shell gives a SIGINT."""
    import os

    try:
        os.write(2, (INTERRUPTED_WHILE_STARTING + "\n").encode())
    except OSError:
        pass
    return 130
