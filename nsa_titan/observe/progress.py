"""Progress bars for long work outside the training loop (eval, export): tqdm on a terminal, silent otherwise."""

from __future__ import annotations

import sys


def progress(what: str):
    """A function wrapping an iterable in a tqdm bar labelled `what`, shown only when stderr is a terminal."""
    from tqdm import tqdm

    return lambda items: tqdm(items, desc=what, disable=not sys.stderr.isatty(), leave=False)
