"""Selected-branch attention backward, deterministic and without an O(T^2) scan.

dK/dV: the selection is inverted into per-key-block lists of queries (selection_lists), so each
key block visits exactly the queries that chose it. Block 0 (and other popular blocks) are chosen
by most queries, so long lists are cut into work items of at most SEGMENT queries; each item writes
its own fp32 partial dK/dV and a second kernel sums a block's partials in item order.

dQ, query layout: one program per (query, batch, KV group), the forward's walk over the n selected
blocks, recomputing P from the saved lse2. Block layout (tile_configs.selected_layout): the dK/dV
kernel, which already holds dS for each (query, head) and key block, also writes dS.K as an fp32
partial per entry and key sub-tile, and a third kernel sums each query's partials in slot order.

No atomics, no dependence on scheduling: bitwise reproducible. Everything is sized from shapes
alone, so there is no host sync.

Packed documents (cu_seqlens, B = 1): selections count blocks from each query's document start;
dQ reads keys from the query's document, and dK/dV numbers the key blocks document after
document (packing.selection_blocks), a block ending at its document's end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.nsa.triton import tile_configs
from components.nsa.triton.launch import LOG2E, dot_precision, flat_grid
from components.nsa.triton.tile_configs import cdiv, head_block, key_tile, next_pow2
from components.nsa.triton.selected_attention_fwd import query_documents
from components.nsa.triton.selection_lists import (bin_position, key_block_span, query_entries, selection_lists,
                                                   work_item, work_item_segment)
from components.nsa.triton.softmax_delta import softmax_delta
from components.nsa.triton.tiles import (grid_position, load_rows, softmax_grads, softmax_grads_by_key,
                                        token_in_document)


@triton.jit
def _selected_attn_bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, IDX, DQ, TOKEN_TABLE,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh, sib, sit, sih, sdqb, sdqt, sdqh,
    T, H, HKV, G, NUM_SEL, SEL_BLOCK, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    SUB_BLOCKS: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr,
):
    t, pid_bh = grid_position(T)
    b = (pid_bh // HKV).to(tl.int64)
    hk = pid_bh % HKV
    t64 = t.to(tl.int64)
    doc0, t_doc = token_in_document(TOKEN_TABLE, t, T, PACKED)  # key rows: doc0 + position in the document

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    g_ok = offs_g < G
    d_ok = offs_d < D
    heads = (hk * G + offs_g).to(tl.int64)
    row_mask = g_ok[:, None] & d_ok[None, :]
    q = load_rows(Q + b * sqb + t64 * sqt, heads, sqh, offs_d, row_mask)
    do = load_rows(DO + b * sdob + t64 * sdot, heads, sdoh, offs_d, row_mask)
    lse2 = tl.load(LSE2 + (b * H + heads) * T + t64, mask=g_ok, other=float("inf"))
    delta = tl.load(DELTA + (b * H + heads) * T + t64, mask=g_ok, other=0.0)

    dq = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = K + b * skb + hk.to(tl.int64) * skh + doc0 * skt
    v_base = V + b * svb + hk.to(tl.int64) * svh + doc0 * svt
    idx_base = IDX + b * sib + t64 * sit + hk.to(tl.int64) * sih
    for slot in range(NUM_SEL):
        blk = tl.load(idx_base + slot)
        for sub in tl.static_range(SUB_BLOCKS):
            in_block = sub * BLOCK_K + offs_k
            pos = blk * SEL_BLOCK + in_block
            k_ok = (in_block < SEL_BLOCK) & (pos >= 0) & (pos <= t_doc)  # pos < 0 for an unused slot (-1)
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = load_rows(k_base, pos.to(tl.int64), skt, offs_d, kv_mask)
            v = load_rows(v_base, pos.to(tl.int64), svt, offs_d, kv_mask)
            _, ds = softmax_grads(q, k, v, do, lse2, delta, k_ok[None, :], qk_scale, PRECISION)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    tl.store(DQ + b * sdqb + t64 * sdqt + heads[:, None] * sdqh + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_mask)


@triton.jit
def _selected_attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, QUERY_LIST, LIST_START, ITEM_BIN, ITEM_START, PART_DK, PART_DV, PART_DQ, BLOCKS,
    STARTS, TOKEN_TABLE,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh,
    T, H, HKV, G: tl.constexpr, NUM_BINS, NUM_SEL_BLOCKS, SEL_BLOCK, SEGMENT, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, QUERIES: tl.constexpr,
    BLOCK_K: tl.constexpr, SUB_BLOCKS: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr,
    WRITE_DQ: tl.constexpr,
):
    item = tl.program_id(0)
    sub = tl.program_id(1)
    if tl.load(ITEM_BIN + item) < NUM_BINS:  # the grid is an upper bound on the number of items
        e_lo, e_hi, blk, hk, b = work_item(item, ITEM_BIN, ITEM_START, LIST_START, NUM_SEL_BLOCKS, HKV, SEGMENT)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        in_block = sub * BLOCK_K + tl.arange(0, BLOCK_K)
        pos, end = key_block_span(BLOCKS, STARTS, blk, NUM_SEL_BLOCKS, SEL_BLOCK, T, PACKED)
        pos = pos + in_block
        k_ok = (in_block < SEL_BLOCK) & (pos < end)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = load_rows(K + b * skb + hk * skh, pos.to(tl.int64), skt, offs_d, kv_mask)
        v = load_rows(V + b * svb + hk * svh, pos.to(tl.int64), svt, offs_d, kv_mask)

        # Rows are (query slot, head) pairs: QUERIES queries of the list times the G heads, back to back
        # (dkdv_step_rows); the rows past QUERIES * G stay empty.
        rows = tl.arange(0, ROWS)
        slot = rows // G
        g = rows % G
        heads = (hk * G + g).to(tl.int64)
        dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
        for e0 in range(e_lo, e_hi, QUERIES):
            entry = e0 + slot
            r_ok = (entry < e_hi) & (slot < QUERIES)
            t = tl.load(QUERY_LIST + entry, mask=r_ok, other=0).to(tl.int64)
            row_mask = r_ok[:, None] & d_ok[None, :]
            q_ptrs = Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :]
            do_ptrs = DO + b * sdob + t[:, None] * sdot + heads[:, None] * sdoh + offs_d[None, :]
            q = tl.load(q_ptrs, mask=row_mask, other=0.0)
            do = tl.load(do_ptrs, mask=row_mask, other=0.0)
            lse2 = tl.load(LSE2 + (b * H + heads) * T + t, mask=r_ok, other=float("inf"))
            delta = tl.load(DELTA + (b * H + heads) * T + t, mask=r_ok, other=0.0)
            # Query t stands at key row t_key of its document (t itself without query offsets).
            key_start, t_pos = token_in_document(TOKEN_TABLE, t, T, PACKED)
            seen_t = r_ok[None, :] & k_ok[:, None] & (pos.to(tl.int64)[:, None] <= (key_start + t_pos)[None, :])
            p_t, ds_t = softmax_grads_by_key(q, k, v, do, lse2, delta, seen_t, qk_scale, PRECISION)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
            if WRITE_DQ:  # this key sub-tile's share of each (query, head)'s dQ, at its entry, as dQ^T = k^T.dS^T
                dq_t = tl.dot(tl.trans(k), ds_t.to(k.dtype), input_precision=PRECISION)
                part = (entry.to(tl.int64) * SUB_BLOCKS + sub) * G + g
                tl.store(PART_DQ + part[None, :] * D + offs_d[:, None], dq_t * sm_scale,
                         mask=r_ok[None, :] & d_ok[:, None])

        offs_r = sub * BLOCK_K + tl.arange(0, BLOCK_K)
        part = item.to(tl.int64) * (SUB_BLOCKS * BLOCK_K * BLOCK_D) + offs_r[:, None] * BLOCK_D + offs_d[None, :]
        tl.store(PART_DK + part, dk * sm_scale)
        tl.store(PART_DV + part, dv)


@triton.jit
def _sum_partials_kernel(
    PART_DK, PART_DV, ITEM_START, DK, DV, BLOCKS, STARTS,
    sdkb, sdkt, sdkh, sdvb, sdvt, sdvh,
    T, HKV, NUM_SEL_BLOCKS, SEL_BLOCK,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PART_ROWS: tl.constexpr, PACKED: tl.constexpr,
):
    # One program per (key block, ROWS rows of it); a partial holds PART_ROWS rows per item.
    bin_id = tl.program_id(0)
    sub = tl.program_id(1)
    blk, hk, b = bin_position(bin_id, NUM_SEL_BLOCKS, HKV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = sub * ROWS + tl.arange(0, ROWS)
    pos, end = key_block_span(BLOCKS, STARTS, blk, NUM_SEL_BLOCKS, SEL_BLOCK, T, PACKED)
    pos = pos + offs_r
    mask = ((offs_r < SEL_BLOCK) & (pos < end))[:, None] & (offs_d < D)[None, :]
    in_part = (offs_r < PART_ROWS)[:, None]

    dk = tl.zeros([ROWS, BLOCK_D], tl.float32)
    dv = tl.zeros([ROWS, BLOCK_D], tl.float32)
    tile = offs_r[:, None] * BLOCK_D + offs_d[None, :]
    first = tl.load(ITEM_START + bin_id).to(tl.int64)
    for i in range(tl.load(ITEM_START + bin_id + 1) - first):
        base = (first + i) * (PART_ROWS * BLOCK_D)
        dk += tl.load(PART_DK + base + tile, mask=in_part, other=0.0)
        dv += tl.load(PART_DV + base + tile, mask=in_part, other=0.0)
    rows = pos.to(tl.int64)[:, None]
    tl.store(DK + b * sdkb + hk * sdkh + rows * sdkt + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + b * sdvb + hk * sdvh + rows * sdvt + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _sum_dq_partials_kernel(
    PART_DQ, ENTRY_OF, IDX, DQ,
    sib, sit, sih, sdqb, sdqt, sdqh,
    T, HKV, G, NUM_SEL,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SUB_BLOCKS: tl.constexpr,
):
    # One program per (query, batch, KV group): per head, its partials summed slot by slot, sub-tile by sub-tile.
    b, hk, t64, used, entry = query_entries(IDX, ENTRY_OF, sib, sit, sih, T, HKV, NUM_SEL, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    mask = used[:, None] & d_ok[None, :]
    for g in range(G):
        dq = tl.zeros([BLOCK_D], tl.float32)
        for sub in tl.static_range(SUB_BLOCKS):
            part = (entry * SUB_BLOCKS + sub) * G + g
            dq += tl.sum(tl.load(PART_DQ + part[:, None] * D + offs_d[None, :], mask=mask, other=0.0), 0)
        tl.store(DQ + b * sdqb + t64 * sdqt + (hk * G + g) * sdqh + offs_d, dq.to(DQ.dtype.element_ty), mask=d_ok)


def selected_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                           lse2: torch.Tensor, sel_idx: torch.Tensor, sel_block_size: int, sm_scale: float,
                           cu_seqlens: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                           segment: int | None = None,
                           dq_layout: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the dtypes of (q, k, v); with cu_seqlens (B = 1) sel_idx counts blocks from
    each query's document start. `segment` (queries per dK/dV work item) and `dq_layout` ("query" or
    "block"; default tile_configs.selected_layout's of the two) only change the work split, not the result
    beyond fp32 summation order. The masked layout is selected_attention_masked's."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    G = H // HKV
    num_sel = sel_idx.shape[-1]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if B * T * H == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = softmax_delta(do, o)  # [B, H, T]
    block_d = head_block(D)
    precision = dot_precision(q.dtype)
    packed = cu_seqlens is not None
    token_table = query_documents(cu_seqlens, cu_seqlens_q, T)
    dq_layout = dq_layout or tile_configs.gather_layout_for(B * T, H, HKV, num_sel, D, sel_block_size,
                                                            q.element_size())
    dq_by_blocks = dq_layout == "block"
    if not dq_by_blocks:
        _selected_dq(q, k, v, do, lse2, delta, sel_idx, dq, token_table, sel_block_size, sm_scale)

    tiles = tile_configs.tiles("selected_dkdv", block_d, q.element_size())
    block_k = key_tile(sel_block_size, tiles.keys)
    sub_blocks = cdiv(sel_block_size, block_k)
    rows, queries = dkdv_step_rows(tiles.rows, G)
    segment = segment or work_item_segment(queries, sel_idx.numel())
    lists = selection_lists(sel_idx, sel_block_size, k.shape[1], segment, cu_seqlens, cu_seqlens_q,
                            entries=dq_by_blocks)
    part_rows = sub_blocks * block_k
    part_shape = (lists.max_items, part_rows, block_d)
    part_dk = torch.empty(part_shape, device=q.device, dtype=torch.float32)
    part_dv = torch.empty(part_shape, device=q.device, dtype=torch.float32)
    # Block layout: an fp32 dQ partial per (entry, key sub-tile, head).
    part_dq = torch.empty(sel_idx.numel() * sub_blocks * G, D, device=q.device, dtype=torch.float32) \
        if dq_by_blocks else None
    _selected_attn_bwd_dkdv_kernel[(lists.max_items, sub_blocks)](
        q, k, v, do, lse2, delta, lists.query_list, lists.list_start, lists.item_bin, lists.item_start,
        part_dk, part_dv, part_dq, lists.blocks, lists.starts, token_table,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        T, H, HKV, G, lists.num_bins, lists.num_sel_blocks, sel_block_size, segment, sm_scale * LOG2E, sm_scale,
        D=D, BLOCK_D=block_d, ROWS=rows, QUERIES=queries, BLOCK_K=block_k, SUB_BLOCKS=sub_blocks,
        PRECISION=precision, PACKED=packed, WRITE_DQ=dq_by_blocks, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    # Both powers of two (tl.arange needs one); rows past part_rows are masked off in the kernel.
    sum_rows = min(next_pow2(part_rows), 2048 // block_d)
    _sum_partials_kernel[(lists.num_bins, cdiv(part_rows, sum_rows))](
        part_dk, part_dv, lists.item_start, dk, dv, lists.blocks, lists.starts,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        T, HKV, lists.num_sel_blocks, sel_block_size,
        D=D, BLOCK_D=block_d, ROWS=sum_rows, PART_ROWS=part_rows, PACKED=packed, num_warps=4,
    )
    if dq_by_blocks:
        _sum_dq_partials_kernel[flat_grid(T, B * HKV)](
            part_dq, lists.entry_of, sel_idx, dq,
            sel_idx.stride(0), sel_idx.stride(1), sel_idx.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
            T, HKV, G, num_sel,
            D=D, BLOCK_D=block_d, BLOCK_N=next_pow2(num_sel), SUB_BLOCKS=sub_blocks, num_warps=4,
        )
    return dq, dk, dv


def dkdv_step_rows(tile_rows: int, group_size: int) -> tuple[int, int]:
    """(rows, queries) of one step of the dK/dV kernel: `rows` (query, head) rows, a power of two of at
    least tile_rows, hold `queries` whole head groups back to back, queries * G <= rows. G = 3 in 32
    rows: 10 queries (30 rows), where padding each group to 4 heads takes 8 (24). On sm_90 in bf16 with
    G = 3 (bench.kernel_resources) this kernel keeps one block of 8 warps per SM at head dims 64 to 256
    (169 registers against 158 at 64), but at 32 it drops from two to one (132 against 128): unmeasured.
    The forward's block layout keeps padded groups: packing cost it ~64 more registers at 4 warps (230
    against 166 at head dim 64), two blocks per SM instead of three."""
    rows = max(tile_rows, next_pow2(group_size))
    return rows, rows // group_size


def _selected_dq(q, k, v, do, lse2, delta, sel_idx, dq, token_table, sel_block_size: int, sm_scale: float) -> None:
    """dq (written in place) by the query-major kernel."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    tiles = tile_configs.tiles("selected_dq", head_block(D), q.element_size())
    block_k = key_tile(sel_block_size, tiles.keys)
    _selected_attn_bwd_dq_kernel[flat_grid(T, B * HKV)](
        q, k, v, do, lse2, delta, sel_idx, dq, token_table,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        sel_idx.stride(0), sel_idx.stride(1), sel_idx.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
        T, H, HKV, H // HKV, sel_idx.shape[-1], sel_block_size, sm_scale * LOG2E, sm_scale,
        D=D, BLOCK_D=head_block(D), BLOCK_G=max(16, next_pow2(H // HKV)), BLOCK_K=block_k,
        SUB_BLOCKS=cdiv(sel_block_size, block_k), PRECISION=dot_precision(q.dtype), PACKED=token_table is not None,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
