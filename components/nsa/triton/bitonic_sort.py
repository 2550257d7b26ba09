"""A descending bitonic sort along the last axis of a [ROWS, N] tile (N a power of two).

tl.sort would do, but it pairs elements through a custom-combine reduction that Triton's CPU
interpreter runs one element at a time; this form pairs them with reshapes and two-element sums,
which the interpreter runs as whole-array operations and the GPU keeps in registers.
"""

import triton
import triton.language as tl


@triton.jit
def _compare_swap(x, ROWS: tl.constexpr, N: tl.constexpr, DIST_LOG: tl.constexpr, STAGE: tl.constexpr):
    # Pair elements 2**DIST_LOG apart; within each run of 2**STAGE elements order them descending
    # when the run's index is even and ascending when odd (the bitonic pattern the next stage merges).
    OUTER: tl.constexpr = N >> (DIST_LOG + 1)
    INNER: tl.constexpr = 1 << DIST_LOG
    y = tl.reshape(x, [ROWS, OUTER, 2, INNER])
    second = (tl.arange(0, 2) == 1)[None, None, :, None]
    a = tl.sum(tl.where(second, 0, y), 2)
    b = tl.sum(tl.where(second, y, 0), 2)
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    desc = (((tl.arange(0, OUTER) >> (STAGE - DIST_LOG - 1)) & 1) == 0)[None, :, None]
    first = tl.where(desc, hi, lo)
    last = tl.where(desc, lo, hi)
    y = tl.where(second, last[:, :, None, :], first[:, :, None, :])
    return tl.reshape(y, [ROWS, N])


@triton.jit
def sort_descending(x, ROWS: tl.constexpr, LOG_N: tl.constexpr):
    """x [ROWS, 2**LOG_N] integer tile -> each row sorted largest first."""
    for stage in tl.static_range(1, LOG_N + 1):
        for step in tl.static_range(stage):
            x = _compare_swap(x, ROWS, 1 << LOG_N, stage - 1 - step, stage)
    return x
