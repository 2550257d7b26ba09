"""Launch shapes of every NSA kernel, by padded head dim and element size, in one place.

Half types (bf16, fp16): the largest tiles whose sm_90 (H100/H200) build keeps all of its state
in registers (ptxas stack frame 0: no spills to local memory) and whose shared memory fits sm_90
and sm_80 (A100); on sm_80 a few spill a little (interval dK/dV at head dims up to 64: 32 B;
selection at 256: up to 88 B). fp32 inputs use true fp32 products, which Triton builds from FMAs rather than
tensor-core MMAs; such a dot holds far more per thread, so fp32 has its own, smaller shapes: the
first of a list of candidates without spills on sm_90, or the one that spills least where none is
clean (interval forward at head dim 128: 56 B; selected forward and dK/dV at 256: 3.8 KiB and 8 B).
`python -m bench.kernel_resources` prints the reports; tests/test_nsa_triton_gpu_build.py holds
the half-type shapes to them. Train in bf16 for speed; fp32 is there for exactness checks.
"""

from __future__ import annotations

from typing import NamedTuple


class Tiles(NamedTuple):
    rows: int  # queries (or query-head rows) per tile
    keys: int  # keys per tile (selected kernels: keys per sub-tile of a selection block, at most)
    warps: int
    stages: int


# fp32 shapes by padded head dim (16 and 32 share the 32 row).
_FP32 = {
    "interval_fwd": {32: Tiles(128, 64, 8, 3), 64: Tiles(32, 32, 4, 2), 128: Tiles(16, 32, 4, 1),
                     256: Tiles(16, 32, 4, 1)},
    "interval_dq": {32: Tiles(128, 32, 8, 2), 64: Tiles(64, 32, 8, 2), 128: Tiles(64, 32, 8, 2),
                    256: Tiles(32, 32, 8, 2)},
    "interval_dkdv": {32: Tiles(32, 128, 8, 2), 64: Tiles(32, 32, 8, 2), 128: Tiles(16, 32, 4, 1),
                      256: Tiles(16, 16, 4, 1)},
    "selection": {32: Tiles(32, 0, 8, 1), 64: Tiles(32, 0, 8, 1), 128: Tiles(32, 0, 8, 1), 256: Tiles(32, 0, 8, 1)},
    "selected_fwd": {32: Tiles(0, 64, 4, 2), 64: Tiles(0, 64, 4, 2), 128: Tiles(0, 64, 4, 2),
                     256: Tiles(0, 32, 8, 2)},
    # One stage at 256: two would need 164 KiB of shared memory, more than an A100 has.
    "selected_dq": {32: Tiles(0, 64, 8, 2), 64: Tiles(0, 64, 8, 2), 128: Tiles(0, 64, 8, 2), 256: Tiles(0, 64, 8, 1)},
    "selected_dkdv": {32: Tiles(32, 32, 8, 2), 64: Tiles(16, 16, 8, 2), 128: Tiles(16, 16, 4, 1),
                      256: Tiles(16, 16, 4, 1)},
}


def _fp32(kernel: str, block_d: int) -> Tiles:
    return _FP32[kernel][max(32, block_d)]


def interval_fwd(block_d: int, element_bytes: int) -> Tiles:
    if element_bytes > 2:
        return _fp32("interval_fwd", block_d)
    if block_d <= 64:
        return Tiles(128, 64, 8, 3)
    if block_d <= 128:
        return Tiles(128, 32, 8, 3)
    return Tiles(64, 32, 8, 2)


def interval_dq(block_d: int, element_bytes: int) -> Tiles:
    if element_bytes > 2:
        return _fp32("interval_dq", block_d)
    if block_d <= 64:
        return Tiles(128, 32, 8, 2)
    if block_d <= 128:
        return Tiles(64, 32, 8, 2)
    return Tiles(32, 64, 8, 2)


def interval_dkdv(block_d: int, element_bytes: int) -> Tiles:
    """The key tile holds two fp32 accumulators [keys, D]: fewer keys for wider heads."""
    if element_bytes > 2:
        return _fp32("interval_dkdv", block_d)
    if block_d <= 64:
        return Tiles(32, 128, 8, 2)
    if block_d <= 128:
        return Tiles(32, 64, 8, 2)
    return Tiles(32, 32, 8, 2)


def selection(block_d: int, element_bytes: int) -> Tiles:
    """One pipeline stage: prefetching the next head's q costs ~140 registers and spills at every
    head dim. keys: compressed blocks per chunk, sized by the launcher from the block geometry."""
    if element_bytes > 2:
        return _fp32("selection", block_d)
    return Tiles(64, 0, 8, 1)


def selected_fwd(block_d: int, element_bytes: int) -> Tiles:
    """rows: the G heads of the group, padded by the launcher."""
    if element_bytes > 2:
        return _fp32("selected_fwd", block_d)
    return Tiles(0, 64, 4 if block_d <= 64 else 8, 2)


def selected_dq(block_d: int, element_bytes: int) -> Tiles:
    if element_bytes > 2:
        return _fp32("selected_dq", block_d)
    return Tiles(0, 32 if block_d == 128 else 64, 8, 2)


def selected_dkdv(block_d: int, element_bytes: int) -> Tiles:
    """rows: (query, head) pairs per step, a whole number of padded head groups."""
    if element_bytes > 2:
        return _fp32("selected_dkdv", block_d)
    return Tiles(32 if block_d <= 128 else 16, 64 if block_d <= 128 else 32, 8, 2)
