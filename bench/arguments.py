"""argparse types for the benchmarks' numbers: a value out of range is argparse's one-line usage error (exit 2),
not a traceback from deep inside the measurement."""

from __future__ import annotations

import argparse
import sys


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


# The stand-in vocabulary (bench.train_throughput.write_standin_bpe): the 256 bytes, distinct two-byte tokens and
# <|endoftext|>.
VOCAB_SIZE_RANGE = (258, 256 + 65536)


def vocab_size(text: str) -> int:
    value = _whole_number_at_least(text, VOCAB_SIZE_RANGE[0])
    if value > VOCAB_SIZE_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{value} is more than {VOCAB_SIZE_RANGE[1]} (the stand-in vocabulary's "
                                         f"largest size)")
    return value


def override_key(text: str) -> str:
    """The field an --override sets ('--training.steps=9' -> 'training.steps'); '' when it names none."""
    return text[2:].partition("=")[0].strip() if text.startswith("--") else ""


def refuse_overrides(overrides: list[str], owned: dict[str, str]) -> str | None:
    """One line naming the first override of a field the benchmark sets itself (`owned`: field -> the option that
    sets it, or '' for none), or None."""
    for text in overrides:
        key = override_key(text)
        if key in owned:
            fix = f"use {owned[key]}" if owned[key] else "drop it"
            return (f"--override={text} sets {key}, which this benchmark sets itself (and records as set). "
                    f"Fix: {fix}.")
    return None


def recipe_problems(argv: list[str], **kwargs) -> str | None:
    """The recipe and its overrides resolved as a benchmark runs them: the recipe's problems as the command line
    prints them, or None."""
    from nsa_titan.config import RecipeError, resolve

    try:
        resolve(argv, **kwargs)
    except RecipeError as exc:
        return exc.render()
    return None


def say_refusal(exc: Exception) -> int:
    """Say a recipe's problems (RecipeError) or a bad input (UserError) on stderr as the command line does; exit 2."""
    from nsa_titan.config import RecipeError

    print(exc.render() if isinstance(exc, RecipeError) else f"error: {exc}", file=sys.stderr)
    return 2
