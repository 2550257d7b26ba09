"""Block selection in one pass over the compressed keys, with a running top-n in registers.

One program per (tile of queries, batch, KV group). It walks the selection blocks in chunks;
for each chunk it recomputes the compressed probabilities p_cmp = exp2(s - lse2) of the G heads
from the compressed branch's saved log-sum-exp (no [T, Tc] matrix in memory), sums the heads,
folds them onto the chunk's selection blocks with one small matmul by the overlap weights, and
merges the chunk into a running top-n (bitonic_sort.merge_top_descending). Scores ride in the
high 32 bits of an int64 sort key and (2**31 - 1 - j) in the low bits, so a descending sort orders
by score and breaks ties toward the smaller block. Non-negative floats order like their bit
patterns; the forced blocks get the three largest patterns (+inf, then the largest finite floats)
in their priority order, invalid ones the key -1.

Packed documents (cu_seqlens, B = 1): a tile holds queries of one document only (packing.py) and
sees that document's compressed blocks, so its block numbers count from the document start. With
query offsets (cu_seqlens_q) the tile's queries stand at positions pos0 + i of their document.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.nsa.triton import tile_configs
from components.nsa.triton.bitonic_sort import merge_top_descending, sort_descending
from components.nsa.triton.launch import LOG2E, dot_precision, flat_grid
from components.nsa.triton.tile_configs import cdiv, head_block, next_pow2
from components.nsa.triton.packing import DocumentTables
from components.nsa.triton.tiles import document_tile


@triton.jit
def _select_blocks_kernel(
    Q, KC, LSE2, OUT, TILES, Q_STARTS, K_STARTS, Q_POS0,
    sqb, sqt, sqh, skb, skt, skh, sob, sot, soh,
    T, TC, H, HKV, G, NUM_TILES, qk_scale,
    CMP_BLOCK, CMP_STRIDE, SEL_BLOCK, NUM_SEL, CHUNK_SEL,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    TOP_PAD: tl.constexpr, TOP_LOG: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr,
):
    # Positions below are within the tile's document: q0 / c0 rows into the row's queries / blocks.
    # Query i of the tile's document stands at position pos0 + i (pos0 = 0 without query offsets).
    tile, pid_bh, q0, num_q, c0, num_c, pos0 = document_tile(TILES, Q_STARTS, K_STARTS, Q_POS0, NUM_TILES,
                                                             tl.cdiv(T, BLOCK_T), T, TC, PACKED)
    b = (pid_bh // HKV).to(tl.int64)
    hk = pid_bh % HKV

    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < num_q
    d_ok = offs_d < D
    pos_t = offs_t + pos0
    current = pos_t // SEL_BLOCK
    cols = tl.arange(0, TOP_PAD)
    t_last = tl.minimum(tile * BLOCK_T + BLOCK_T, num_q) - 1
    num_valid = (t_last + pos0) // SEL_BLOCK + 1  # blocks 0 .. current of the tile's last query
    if PACKED:  # a spare program has no query (t_last = -1): no block to walk
        num_valid = tl.where(t_last >= 0, num_valid, 0)

    top = tl.full([BLOCK_T, TOP_PAD], -1, tl.int64)
    for j0 in range(0, num_valid, CHUNK_SEL):
        # Compressed blocks overlapping selection blocks j0 .. j0 + CHUNK_SEL - 1 start at the
        # first i with i*d + l > j0*l'; the launcher sized BLOCK_C to hold all of them.
        i_lo = tl.maximum(j0 * SEL_BLOCK - CMP_BLOCK + CMP_STRIDE, 0) // CMP_STRIDE
        offs_c = i_lo + tl.arange(0, BLOCK_C)
        c_ok = offs_c < num_c
        kc = tl.load(KC + b * skb + hk.to(tl.int64) * skh + (c0 + offs_c.to(tl.int64))[:, None] * skt
                     + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        seen = ((offs_c * CMP_STRIDE + CMP_BLOCK - 1)[None, :] <= pos_t[:, None]) & c_ok[None, :]

        p_group = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for g in range(G):
            h64 = (hk * G + g).to(tl.int64)
            q = tl.load(Q + b * sqb + h64 * sqh + (q0 + offs_t.to(tl.int64))[:, None] * sqt + offs_d[None, :],
                        mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            lse2 = tl.load(LSE2 + (b * H + h64) * T + q0 + offs_t, mask=t_ok, other=float("inf"))
            s = tl.dot(q, tl.trans(kc), input_precision=PRECISION) * qk_scale
            p_group += tl.where(seen, tl.exp2(s - lse2[:, None]), 0.0)

        # Overlap weights ov(i, j) = shared tokens / d (the reference's exact small integers).
        offs_j = j0 + cols
        c_start = offs_c * CMP_STRIDE
        shared = (tl.minimum((offs_j[None, :] + 1) * SEL_BLOCK, c_start[:, None] + CMP_BLOCK)
                  - tl.maximum(offs_j[None, :] * SEL_BLOCK, c_start[:, None]))
        ov = tl.maximum(shared, 0) // CMP_STRIDE
        ov = tl.where(c_ok[:, None] & (cols < CHUNK_SEL)[None, :], ov, 0).to(tl.float32)
        score = tl.dot(p_group, ov, input_precision="ieee")  # [BLOCK_T, TOP_PAD]

        valid = (offs_j[None, :] <= current[:, None]) & (cols < CHUNK_SEL)[None, :]
        jj = offs_j[None, :]
        # Forced blocks above every score, in priority order: the current block (+inf's pattern),
        # block 0 (the largest finite float's), the previous block (the one below it).
        bits = tl.maximum(score.to(tl.int32, bitcast=True), 0)
        bits = tl.where(jj == current[:, None] - 1, 0x7F7FFFFE, bits)
        bits = tl.where(jj == 0, 0x7F7FFFFF, bits)
        bits = tl.where(jj == current[:, None], 0x7F800000, bits).to(tl.int64)
        key = (bits << 32) | (2147483647 - offs_j).to(tl.int64)[None, :]  # 2**31 - 1 - j
        key = tl.where(valid, key, -1)

        top = merge_top_descending(top, key, BLOCK_T, TOP_LOG)

    # Ascending block order with -1 last: sort the low bits (2**31 - 1 - j) descending.
    chosen = (cols[None, :] < NUM_SEL) & (top >= 0)
    low = sort_descending(tl.where(chosen, top & 2147483647, -1), BLOCK_T, TOP_LOG)
    block = tl.where(low >= 0, 2147483647 - low, -1)
    tl.store(OUT + b * sob + hk.to(tl.int64) * soh + (q0 + offs_t.to(tl.int64))[:, None] * sot + cols[None, :],
             block.to(tl.int64), mask=t_ok[:, None] & (cols < NUM_SEL)[None, :])


def _chunk_sizes(block_size: int, block_stride: int, sel_block_size: int, num_selected: int) -> tuple[int, int, int]:
    """(TOP_PAD, BLOCK_C, CHUNK_SEL): padded top-n width, compressed blocks loaded per chunk, and
    the most selection blocks whose overlapping compressed blocks all fit in BLOCK_C."""
    top_pad = max(16, next_pow2(num_selected))
    block_c = max(64, next_pow2((sel_block_size + block_size - 1) // block_stride + 2))

    def needed(chunk: int) -> int:  # compressed blocks touching `chunk` consecutive selection blocks
        return (chunk * sel_block_size + block_size - 1) // block_stride + 2

    chunk = 1
    while chunk < top_pad and needed(chunk + 1) <= block_c:
        chunk += 1
    return top_pad, block_c, chunk


def select_blocks_kernel(q: torch.Tensor, k_cmp: torch.Tensor, lse2_cmp: torch.Tensor, *, block_size: int,
                         block_stride: int, sel_block_size: int, num_selected: int, sm_scale: float,
                         cu_seqlens: torch.Tensor | None = None,
                         cu_seqlens_q: torch.Tensor | None = None) -> torch.Tensor:
    """LongTensor [B, T, Hkv, n] from q [B, T, H, D], k_cmp [B, Tc, Hkv, D] and the compressed
    branch's lse2 [B, H, T]; with cu_seqlens (B = 1), each packed document's own selection (and with
    cu_seqlens_q, for each document's last queries)."""
    B, T, H, D = q.shape
    TC, HKV = k_cmp.shape[1], k_cmp.shape[2]
    out = torch.empty(B, T, HKV, num_selected, device=q.device, dtype=torch.int64)
    if B * T * H == 0:
        return out
    if TC == 0:
        k_cmp = q.new_zeros(B, 1, HKV, D)  # every load is masked off; the kernel only needs an address
    top_pad, block_c, chunk = _chunk_sizes(block_size, block_stride, sel_block_size, num_selected)
    tiles = tile_configs.tiles("selection", head_block(D), q.element_size())
    docs = DocumentTables.of(cu_seqlens, block_stride, block_size - 1, cu_seqlens_q)
    *tables, num_tiles = docs.tiles(tiles.rows, T)
    _select_blocks_kernel[flat_grid(num_tiles or cdiv(T, tiles.rows), B * HKV)](
        q, k_cmp, lse2_cmp, out, *tables,
        q.stride(0), q.stride(1), q.stride(2), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        T, TC, H, HKV, H // HKV, num_tiles, sm_scale * LOG2E,
        block_size, block_stride, sel_block_size, num_selected, chunk,
        D=D, BLOCK_D=head_block(D), BLOCK_T=tiles.rows, BLOCK_C=block_c, TOP_PAD=top_pad,
        TOP_LOG=top_pad.bit_length() - 1,
        PRECISION=dot_precision(q.dtype), PACKED=cu_seqlens is not None, num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return out
