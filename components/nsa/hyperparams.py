"""The NSA hyperparameters and the rules that make a configuration valid (NSA_SPEC.md).

The one statement of those rules: the op checks its arguments with them and the model's
arguments (components/models/args.py) report them as recipe problems.
"""

from __future__ import annotations

from components.problems import Problem, problem, raise_problems

# Spec names, in the order the op takes them.
HYPERPARAMETER_NAMES = ("block_size", "block_stride", "sel_block_size", "num_selected", "window_size")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def hyperparameter_problems(
    block_size: int, block_stride: int, sel_block_size: int, num_selected: int, window_size: int
) -> list[Problem]:
    """Every rule the five hyperparameters break, fields named as in HYPERPARAMETER_NAMES."""
    values = dict(
        zip(HYPERPARAMETER_NAMES, (block_size, block_stride, sel_block_size, num_selected, window_size), strict=True)
    )
    problems = []
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(problem(name, value, f"must be an int, got {type(value).__name__}",
                                    "use a whole number"))
        elif value < 1:
            problems.append(problem(name, value, "must be at least 1", "give a positive whole number"))
    if problems:
        return problems
    l, d, ls = block_size, block_stride, sel_block_size
    if l % d:
        problems.append(problem("block_stride", d, f"must divide block_size ({l})",
                                f"use one of {divisors(l)} or change block_size to a multiple of {d}"))
    if ls % d:
        problems.append(problem("block_stride", d, f"must divide sel_block_size ({ls})",
                                f"use one of {divisors(ls)} or change sel_block_size to a multiple of {d}"))
    if l > ls:
        problems.append(problem("sel_block_size", ls, f"must be >= block_size ({l})",
                                f"raise sel_block_size to {l} or more, or lower block_size"))
    return problems


def check_hyperparameters(
    block_size: int, block_stride: int, sel_block_size: int, num_selected: int, window_size: int
) -> None:
    """Raise UserError naming every broken rule; return quietly for a valid configuration."""
    raise_problems("invalid NSA hyperparameters",
                   hyperparameter_problems(block_size, block_stride, sel_block_size, num_selected, window_size))


def num_selection_blocks(num_tokens: int, sel_block_size: int) -> int:
    """Ts = ceil(T / l'): selection block j covers tokens [j*l', (j+1)*l'), the last one may be partial."""
    return -(-num_tokens // sel_block_size)
