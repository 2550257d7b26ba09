"""Launch shapes of every NSA kernel, by padded head dim and element size, in one place.

Half types (bf16, fp16): the largest tiles whose sm_90 (H100/H200) build keeps all of its state
in registers (ptxas stack frame 0: no spills to local memory) and whose shared memory fits sm_90
and sm_80 (A100); on sm_80 a few spill (the block layout's selected dK/dV, which writes dQ too:
56 B at head dim 128, 432 B at 256; summing dQ partials at 256: 16 B; Triton 3.9's ptxas). fp32
inputs use true fp32 products, which Triton builds from FMAs rather than tensor-core MMAs; such a dot
holds far more per thread, so fp32 has its own, smaller shapes: the first of a list of candidates
without spills on sm_90, or the one that spills least where none is clean (interval forward at head dim 128: 56 B;
selected forward and dK/dV at 256: 3.8 KiB and 8 B). `python -m bench.kernel_resources` prints the reports;
tests/test_nsa_triton_gpu_build.py holds the half-type shapes to them. Train in bf16 for speed;
fp32 is there for exactness checks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple


class Tiles(NamedTuple):
    rows: int  # queries per tile; block-major selected kernels: (query, head) rows per step, whole head groups
    keys: int  # keys per tile; selected kernels: keys per sub-tile of a selection block, at most
    warps: int
    stages: int


# kernel -> padded head dim (16 reads the 32 entry) -> shape. rows 0: the selected kernels take the
# G heads of a group as their rows (padded by the launcher); keys 0: the selection kernel sizes its
# chunk of compressed blocks from the block geometry.
_HALF = {
    "interval_fwd": {32: Tiles(128, 64, 8, 3), 64: Tiles(128, 64, 8, 3), 128: Tiles(128, 32, 8, 3),
                     256: Tiles(64, 32, 8, 2)},
    "interval_dq": {32: Tiles(128, 32, 8, 2), 64: Tiles(128, 32, 8, 2), 128: Tiles(64, 32, 8, 2),
                    256: Tiles(32, 64, 8, 2)},
    # The key tile holds two fp32 accumulators [keys, D]: fewer keys for wider heads. One stage at 128:
    # Triton 3.6's two-stage build of this loop went wrong on an H100 in bf16 (dK differed run to run,
    # 6e-3 to 7e-2 relative RMS off the reference; dV stayed right), as did 128 keys; one stage was
    # exact and deterministic (tests/test_nsa_triton_gpu.py's backward checks). That build fed dK's dot
    # the transpose of dS, a shape Hopper builds miscompile (tiles.softmax_grads_by_key, which the
    # kernel now uses, avoids it); one stage stays until a GPU run shows two right.
    "interval_dkdv": {32: Tiles(32, 128, 8, 2), 64: Tiles(32, 128, 8, 2), 128: Tiles(32, 64, 8, 1),
                      256: Tiles(32, 32, 8, 2)},
    # One pipeline stage: prefetching the next head's q costs ~140 registers and spills at every head dim.
    "selection": {32: Tiles(64, 0, 8, 1), 64: Tiles(64, 0, 8, 1), 128: Tiles(64, 0, 8, 1), 256: Tiles(64, 0, 8, 1)},
    "selected_fwd": {32: Tiles(0, 64, 4, 2), 64: Tiles(0, 64, 4, 2), 128: Tiles(0, 64, 8, 2), 256: Tiles(0, 64, 8, 2)},
    "selected_dq": {32: Tiles(0, 64, 8, 2), 64: Tiles(0, 64, 8, 2), 128: Tiles(0, 32, 8, 2), 256: Tiles(0, 64, 8, 2)},
    "selected_dkdv": {32: Tiles(32, 64, 8, 2), 64: Tiles(32, 64, 8, 2), 128: Tiles(32, 64, 8, 2),
                      256: Tiles(16, 32, 8, 2)},
    "selected_fwd_blocks": {32: Tiles(64, 64, 4, 2), 64: Tiles(64, 64, 4, 2), 128: Tiles(32, 64, 4, 2),
                            256: Tiles(16, 32, 8, 2)},
}
_FP32 = {
    "interval_fwd": {32: Tiles(128, 64, 8, 3), 64: Tiles(32, 32, 4, 2), 128: Tiles(16, 32, 4, 1),
                     256: Tiles(16, 32, 4, 1)},
    "interval_dq": {32: Tiles(128, 32, 8, 2), 64: Tiles(64, 32, 8, 2), 128: Tiles(64, 32, 8, 2),
                    256: Tiles(32, 32, 8, 2)},
    "interval_dkdv": {32: Tiles(32, 128, 8, 2), 64: Tiles(32, 32, 8, 2), 128: Tiles(16, 32, 4, 1),
                      256: Tiles(16, 16, 4, 1)},
    "selection": {32: Tiles(32, 0, 8, 1), 64: Tiles(32, 0, 8, 1), 128: Tiles(32, 0, 8, 1), 256: Tiles(32, 0, 8, 1)},
    "selected_fwd": {32: Tiles(0, 64, 4, 2), 64: Tiles(0, 64, 4, 2), 128: Tiles(0, 64, 4, 2), 256: Tiles(0, 32, 8, 2)},
    # One stage at 256: two would need 164 KiB of shared memory, more than an A100 has.
    "selected_dq": {32: Tiles(0, 64, 8, 2), 64: Tiles(0, 64, 8, 2), 128: Tiles(0, 64, 8, 2), 256: Tiles(0, 64, 8, 1)},
    "selected_dkdv": {32: Tiles(32, 32, 8, 2), 64: Tiles(16, 16, 8, 2), 128: Tiles(16, 16, 4, 1),
                      256: Tiles(16, 16, 4, 1)},
    "selected_fwd_blocks": {32: Tiles(32, 32, 4, 2), 64: Tiles(32, 32, 4, 2), 128: Tiles(16, 32, 4, 1),
                            256: Tiles(16, 16, 4, 1)},
}


KERNELS = tuple(_HALF)
HEAD_BLOCKS = tuple(_HALF["interval_fwd"])  # the padded head dims with a shape of their own (16 reads 32's)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def head_block(head_dim: int) -> int:
    """Padded head dim: a power of two and at least 16 (tl.dot's minimum inner size)."""
    return max(16, next_pow2(head_dim))


def key_tile(sel_block_size: int, cap: int) -> int:
    """Keys per sub-tile of a selection block: the whole block, up to `cap`."""
    return max(16, min(cap, next_pow2(sel_block_size)))


def table_head_block(block_d: int) -> int:
    """The head dim entry of the shape tables that padded head dim block_d reads (16 reads 32's)."""
    return max(32, block_d)


def _shapes_of(kernel: str, block_d: int, element_bytes: int) -> tuple[dict[int, Tiles], int]:
    """(the table of `kernel`'s shapes by head dim for this element size, the entry block_d reads)."""
    return (_HALF if element_bytes <= 2 else _FP32)[kernel], table_head_block(block_d)


def tiles(kernel: str, block_d: int, element_bytes: int) -> Tiles:
    """The launch shape of `kernel` for padded head dim block_d (16 to 256) and input element size."""
    table, key = _shapes_of(kernel, block_d, element_bytes)
    return table[key]


@contextmanager
def overridden(kernel: str, block_d: int, element_bytes: int, shape: Tiles) -> Iterator[None]:
    """Launch `kernel` with `shape` where tiles() would give its own, until the block ends: for timing
    candidate shapes side by side (bench.tile_variants), not for training."""
    table, key = _shapes_of(kernel, block_d, element_bytes)
    own = table[key]
    table[key] = shape
    try:
        yield
    finally:
        table[key] = own


BLOCK_LAYOUT_MAX_GROUP = 4
BLOCK_LAYOUT_MAX_PARTIAL_BYTES = 4 * 2**30


def block_layout_partial_bytes(tokens: int, heads: int, num_selected: int, head_dim: int, sel_block_size: int,
                               element_bytes: int) -> int:
    """The block layout's fp32 partials for one call of B x T = tokens queries, the larger of its two
    passes': the forward's output row and log-sum-exp per (query, head, selected block), and the
    backward's dQ row per the same and per key sub-tile of a selection block (selected dK/dV's key
    tile: two sub-tiles for blocks of 128 keys, or at head dim 256)."""
    keys = key_tile(sel_block_size, tiles("selected_dkdv", head_block(head_dim), element_bytes).keys)
    per_entry = max(head_dim + 1, cdiv(sel_block_size, keys) * head_dim)
    return tokens * heads * num_selected * per_entry * 4


def selected_layout(group_size: int, partial_bytes: int) -> str:
    """How the selected branch's forward and dQ walk the selection: "query" (one program per query and
    KV group, its G heads padded to at least 16 rows, the n blocks' keys read per query) or "block"
    (one pass per selected key block over the queries that chose it, fp32 partials merged per
    query; selected_attention_fwd_blocks). dK/dV is block-major either way. The block layout is
    built for small groups, where query-major pads most rows; its partials (partial_bytes, from
    block_layout_partial_bytes) live for the length of the call, so past
    BLOCK_LAYOUT_MAX_PARTIAL_BYTES the query layout, which needs none, is taken. Measured on an H100
    in bf16 with G = 3, D = 64, n = 16 (bench.attention_stages, forward + backward): block 3.7 ms
    against query 4.1 at 8k tokens, 16.1 against 28.0 at 64k (3.2 GiB of partials). Groups of up to 4
    heads fill at most a quarter of query-major's 16 rows, so they take the block layout; larger
    groups (unmeasured) stay query-major."""
    small = group_size <= BLOCK_LAYOUT_MAX_GROUP and partial_bytes <= BLOCK_LAYOUT_MAX_PARTIAL_BYTES
    return "block" if small else "query"


MASKED_LAYOUT_MAX_ROW = 4  # rows of at most this many times n * l' keys take the masked layout


def masked_layout_pays(row_keys: int, num_selected: int, sel_block_size: int) -> bool:
    """Whether the selected branch runs as causal flash attention hiding the unselected blocks
    (selection_mask.py) rather than gathering the selected ones: where a row's keys are few against
    the n * l' keys a query selects, the masked layout does at most about twice the gather's products
    (MASKED_LAYOUT_MAX_ROW = 4) in kernels built like dense flash attention. Estimated from the H200
    run of bench.attention_stages at 32 rows of 2k (125M heads, bf16): the window branch, the same
    kernels over ~450 keys a query, took 0.46 / 1.72 ms forward / backward against the block layout's
    4.38 / 6.97 over ~770; the masked layout visits ~1,020 a query."""
    return masked_layout_fits(sel_block_size) and row_keys <= MASKED_LAYOUT_MAX_ROW * num_selected * sel_block_size


def masked_layout_fits(sel_block_size: int) -> bool:
    """The masked layout's key tiles (16 keys or more: tl.dot's least size) lie inside one selection block."""
    return sel_block_size % 16 == 0


def selected_layout_for(tokens: int, heads: int, kv_heads: int, num_selected: int, head_dim: int,
                        sel_block_size: int, element_bytes: int, row_keys: int) -> str:
    """The selected branch's layout for one call of B x T = tokens queries over rows of row_keys keys:
    "masked" where masked_layout_pays, else selected_layout's from its group size and partials."""
    if masked_layout_pays(row_keys, num_selected, sel_block_size):
        return "masked"
    return gather_layout_for(tokens, heads, kv_heads, num_selected, head_dim, sel_block_size, element_bytes)


def gather_layout_for(tokens: int, heads: int, kv_heads: int, num_selected: int, head_dim: int,
                      sel_block_size: int, element_bytes: int) -> str:
    """selected_layout ("query" or "block") for one call of B x T = tokens queries: its group size and partials."""
    partials = block_layout_partial_bytes(tokens, heads, num_selected, head_dim, sel_block_size, element_bytes)
    return selected_layout(heads // kv_heads, partials)
