"""Selected-branch attention forward, block-major: one pass per selected key block, then a merge.

For small head groups (G = 3 in the 125M layout) the query-major forward pads the G heads of a query
to 16 rows for tl.dot and reads the n selected blocks' keys and values once per query. Here the
selection is turned around (selection_lists): a work item takes one key block and the queries that
chose it, loads the block's keys and values once, and computes, QUERIES queries x G heads at a
time, each (query, head)'s softmax over that block alone: a normalised partial output and its
log2-sum-exp2, stored fp32 at the entry's place in the lists. A second kernel merges each query's n
partials in slot order (base-2 log-sum-exp weights), so the result is bitwise reproducible and
equals the query-major forward up to fp32 summation order. The partials cost
B * T * Hkv * n * G * (D + 1) fp32 for the duration of the call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.nsa.triton import tile_configs
from components.nsa.triton.launch import LOG2E, dot_precision, flat_grid
from components.nsa.triton.tile_configs import cdiv, head_block, key_tile, next_pow2
from components.nsa.triton.selected_attention_fwd import forward_outputs, query_documents
from components.nsa.triton.selection_lists import (key_block_span, query_entries, selection_lists, work_item,
                                                   work_item_segment)
from components.nsa.triton.tiles import load_rows, online_softmax_step, token_in_document


@triton.jit
def _selected_fwd_blocks_kernel(
    Q, K, V, QUERY_LIST, LIST_START, ITEM_BIN, ITEM_START, PART_O, PART_LSE, BLOCKS, STARTS, TOKEN_TABLE,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    T, HKV, G, NUM_BINS, NUM_SEL_BLOCKS, SEL_BLOCK, SEGMENT, qk_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, QUERIES: tl.constexpr,
    BLOCK_K: tl.constexpr, SUB_BLOCKS: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr,
):
    item = tl.program_id(0)
    if tl.load(ITEM_BIN + item) < NUM_BINS:  # the grid is an upper bound on the number of items
        e_lo, e_hi, blk, hk, b = work_item(item, ITEM_BIN, ITEM_START, LIST_START, NUM_SEL_BLOCKS, HKV, SEGMENT)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k = tl.arange(0, BLOCK_K)
        d_ok = offs_d < D
        block_start, block_end = key_block_span(BLOCKS, STARTS, blk, NUM_SEL_BLOCKS, SEL_BLOCK, T, PACKED)
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
        if SUB_BLOCKS == 1:  # the whole block in one tile: load it once for the item
            pos_1 = block_start + offs_k
            ok_1 = (offs_k < SEL_BLOCK) & (pos_1 < block_end)
            k_1 = load_rows(k_base, pos_1.to(tl.int64), skt, offs_d, ok_1[:, None] & d_ok[None, :])
            v_1 = load_rows(v_base, pos_1.to(tl.int64), svt, offs_d, ok_1[:, None] & d_ok[None, :])

        # Rows are (query slot, head) pairs: QUERIES queries of the list times the G heads.
        rows = tl.arange(0, QUERIES * BLOCK_G)
        slot = rows // BLOCK_G
        g = rows % BLOCK_G
        heads = (hk * G + g).to(tl.int64)
        for e0 in range(e_lo, e_hi, QUERIES):
            entry = e0 + slot
            r_ok = (entry < e_hi) & (g < G)
            t = tl.load(QUERY_LIST + entry, mask=r_ok, other=0).to(tl.int64)
            row_mask = r_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :], mask=row_mask,
                        other=0.0)
            key_start, t_pos = token_in_document(TOKEN_TABLE, t, T, PACKED)
            last_key = key_start + t_pos  # the query's own token: the last key it may see
            m_i = tl.full([QUERIES * BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([QUERIES * BLOCK_G], tl.float32)
            acc = tl.zeros([QUERIES * BLOCK_G, BLOCK_D], tl.float32)
            for sub in tl.static_range(SUB_BLOCKS):
                in_block = sub * BLOCK_K + offs_k
                pos = block_start + in_block
                if SUB_BLOCKS == 1:
                    k = k_1
                    v = v_1
                else:
                    k_ok = (in_block < SEL_BLOCK) & (pos < block_end)
                    k = load_rows(k_base, pos.to(tl.int64), skt, offs_d, k_ok[:, None] & d_ok[None, :])
                    v = load_rows(v_base, pos.to(tl.int64), svt, offs_d, k_ok[:, None] & d_ok[None, :])
                seen = (r_ok[:, None] & (in_block < SEL_BLOCK)[None, :] & (pos < block_end)[None, :]
                        & (pos.to(tl.int64)[None, :] <= last_key[:, None]))
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, tl.where(seen, s, float("-inf")), v, PRECISION)
            # A partial that saw no key (not reachable for a valid selection) weighs 0 in the merge.
            seen_any = l_i > 0.0
            o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
            lse = tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
            out = entry.to(tl.int64) * G + g
            tl.store(PART_O + out[:, None] * D + offs_d[None, :], o, mask=row_mask)
            tl.store(PART_LSE + out, lse, mask=r_ok)


@triton.jit
def _merge_partials_kernel(
    PART_O, PART_LSE, ENTRY_OF, IDX, O, LSE2,
    sib, sit, sih, sob, sot, soh,
    T, H, HKV, G, NUM_SEL,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (query, batch, KV group): its n partials per head, merged in slot order.
    b, hk, t64, used, entry = query_entries(IDX, ENTRY_OF, sib, sit, sih, T, HKV, NUM_SEL, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    for g in range(G):
        part = entry * G + g
        lse = tl.load(PART_LSE + part, mask=used, other=float("-inf"))
        m = tl.max(lse, 0)
        m_shift = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m_shift)
        total = tl.sum(w, 0)
        o_part = tl.load(PART_O + part[:, None] * D + offs_d[None, :], mask=used[:, None] & d_ok[None, :], other=0.0)
        o = tl.sum(w[:, None] * o_part, 0) / tl.where(total > 0.0, total, 1.0)
        head = hk * G + g
        tl.store(O + b * sob + t64 * sot + head * soh + offs_d, o.to(O.dtype.element_ty), mask=d_ok)
        tl.store(LSE2 + (b * H + head) * T + t64, tl.where(total > 0.0, m + tl.log2(total), float("inf")))


def selected_attention_fwd_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel_idx: torch.Tensor,
                                  sel_block_size: int, sm_scale: float, cu_seqlens: torch.Tensor | None = None,
                                  cu_seqlens_q: torch.Tensor | None = None,
                                  segment: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As selected_attention_fwd (same arguments, same result up to fp32 summation order); `segment`
    (queries per work item) only changes the work split."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    G = H // HKV
    num_sel = sel_idx.shape[-1]
    o, lse2 = forward_outputs(q)
    if B * T * H == 0:
        return o, lse2
    block_d = head_block(D)
    tiles = tile_configs.tiles("selected_fwd_blocks", block_d, q.element_size())
    block_k = key_tile(sel_block_size, tiles.keys)
    block_g = next_pow2(G)
    queries = max(1, tiles.rows // block_g)  # (query, head) rows per step: whole padded head groups
    segment = segment or work_item_segment(queries, sel_idx.numel())
    lists = selection_lists(sel_idx, sel_block_size, k.shape[1], segment, cu_seqlens, cu_seqlens_q, entries=True)
    entries = sel_idx.numel()
    part_o = torch.empty(entries * G, D, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(entries * G, device=q.device, dtype=torch.float32)
    token_table = query_documents(cu_seqlens, cu_seqlens_q, T)
    _selected_fwd_blocks_kernel[(lists.max_items,)](
        q, k, v, lists.query_list, lists.list_start, lists.item_bin, lists.item_start, part_o, part_lse,
        lists.blocks, lists.starts, token_table,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        T, HKV, G, lists.num_bins, lists.num_sel_blocks, sel_block_size, segment, sm_scale * LOG2E,
        D=D, BLOCK_D=block_d, BLOCK_G=block_g, QUERIES=queries, BLOCK_K=block_k,
        SUB_BLOCKS=cdiv(sel_block_size, block_k), PRECISION=dot_precision(q.dtype), PACKED=cu_seqlens is not None,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
    _merge_partials_kernel[flat_grid(T, B * HKV)](
        part_o, part_lse, lists.entry_of, sel_idx, o, lse2,
        sel_idx.stride(0), sel_idx.stride(1), sel_idx.stride(2), o.stride(0), o.stride(1), o.stride(2),
        T, H, HKV, G, num_sel,
        D=D, BLOCK_D=block_d, BLOCK_N=next_pow2(num_sel), num_warps=4,
    )
    return o, lse2
