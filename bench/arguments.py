"""argparse types for the benchmarks' numbers: a value out of range is argparse's one-line usage error (exit 2),
not a traceback from deep inside the measurement."""

from __future__ import annotations

import argparse


def _whole_number_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is not at least {low}")
    return value


def positive_int(text: str) -> int:
    return _whole_number_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _whole_number_at_least(text, 0)


def fraction(text: str) -> float:
    """A place in [0, 1): where in an epoch, say (1 is its end, past its last document)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1)")
    return value
