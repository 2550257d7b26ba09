"""The NSA hyperparameters and the rules that make a configuration valid (NSA_SPEC.md)."""

from __future__ import annotations

from components.errors import UserError

# Spec names, in the order the op takes them.
HYPERPARAMETER_NAMES = ("block_size", "block_stride", "sel_block_size", "num_selected", "window_size")


def hyperparameter_problems(
    block_size: int, block_stride: int, sel_block_size: int, num_selected: int, window_size: int
) -> list[tuple[str, str]]:
    """Every rule the five hyperparameters break, as (field name, message with the fix)."""
    values = dict(
        zip(HYPERPARAMETER_NAMES, (block_size, block_stride, sel_block_size, num_selected, window_size), strict=True)
    )
    problems = []
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            kind = type(value).__name__
            problems.append((name, f"{name} must be an int, got {value!r} ({kind}); use a whole number"))
        elif value < 1:
            problems.append((name, f"{name} must be >= 1, got {value}; give a positive whole number"))
    if problems:
        return problems
    l, d, lp = block_size, block_stride, sel_block_size
    if l % d:
        problems.append(("block_stride", f"block_stride {d} must divide block_size {l}; pick a divisor of {l}"))
    if lp % d:
        problems.append(
            ("block_stride", f"block_stride {d} must divide sel_block_size {lp}; pick a common divisor of {l} and {lp}")
        )
    if l > lp:
        problems.append(("sel_block_size", f"block_size {l} must be <= sel_block_size {lp}; "
                         f"raise sel_block_size to a multiple of block_stride that is >= {l}"))
    return problems


def check_hyperparameters(
    block_size: int, block_stride: int, sel_block_size: int, num_selected: int, window_size: int
) -> None:
    """Raise UserError naming every broken rule; return quietly for a valid configuration."""
    problems = hyperparameter_problems(block_size, block_stride, sel_block_size, num_selected, window_size)
    if problems:
        raise UserError("invalid NSA hyperparameters: " + "; ".join(message for _, message in problems))


def num_selection_blocks(num_tokens: int, sel_block_size: int) -> int:
    """Ts = ceil(T / l'): selection block j covers tokens [j*l', (j+1)*l'), the last one may be partial."""
    return -(-num_tokens // sel_block_size)
