"""A descending bitonic sort along the last axis of a [ROWS, N] tile (N a power of two), and a running
top-N merge built from it.

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


@triton.jit
def merge_top_descending(top, new, ROWS: tl.constexpr, LOG_N: tl.constexpr):
    """The N = 2**LOG_N largest of `top` (each row sorted largest first) and `new` (any order), each row
    sorted largest first. `new` is sorted ascending (a descending sort of its negation; the keys never
    reach the integer minimum, so negation is exact); the pairwise maximum of a descending and an
    ascending row then holds exactly the N largest of both, as a bitonic row (a bitonic merge's first
    half-cleaner), which the sort's last stage orders. For N = 16: 14 compare-swap steps on 16
    columns, where sorting the two rows joined took 15 on 32."""
    rising = -sort_descending(-new, ROWS, LOG_N)
    x = tl.maximum(top, rising)
    for step in tl.static_range(LOG_N):
        x = _compare_swap(x, ROWS, 1 << LOG_N, LOG_N - 1 - step, LOG_N)
    return x
