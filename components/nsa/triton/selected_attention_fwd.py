"""Selected-branch attention forward: each query attends to the tokens s <= t of its n blocks.

One program per (query, batch, KV group). The G query heads of the group share the selection,
so the program loads them all as the rows of one tile (padded to at least 16 rows for tl.dot),
walks the n selected blocks in sub-tiles of BLOCK_K keys and keeps an fp32 online softmax.
Unused slots (-1) are masked off. lse2 [B, H, T] (base-2, +inf for an empty row) is saved for
the backward. Packed documents (cu_seqlens, B = 1): block numbers count from the query's document
start (packing.query_token_table gives it per query), so keys never come from another document.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.nsa.triton import tile_configs
from components.nsa.triton.launch import LOG2E, dot_precision, flat_grid
from components.nsa.triton.tile_configs import cdiv, head_block, next_pow2
from components.nsa.triton.packing import kept, query_token_table
from components.nsa.triton.tiles import (grid_position, load_rows, online_softmax_step, softmax_result,
                                         token_in_document)


@triton.jit
def _selected_attn_fwd_kernel(
    Q, K, V, IDX, O, LSE2, TOKEN_TABLE,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sib, sit, sih, sob, sot, soh,
    T, H, HKV, G, NUM_SEL, SEL_BLOCK, qk_scale,
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

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
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
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, tl.where(k_ok[None, :], s, float("-inf")), v,
                                                PRECISION)

    o, lse2 = softmax_result(m_i, l_i, acc)
    tl.store(O + b * sob + t64 * sot + heads[:, None] * soh + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_mask)
    tl.store(LSE2 + (b * H + heads) * T + t64, lse2, mask=g_ok)


def query_documents(cu_seqlens: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                    num_queries: int) -> torch.Tensor | None:
    """The kernels' TOKEN_TABLE (packing.query_token_table), or None for one unpacked row."""
    if cu_seqlens is None:
        return None
    return kept(cu_seqlens, cu_seqlens_q, ("query tokens", num_queries),
                lambda: query_token_table(cu_seqlens, cu_seqlens_q, num_queries))


def forward_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (o like q, contiguous; lse2 [B, H, T] fp32) for a selected forward to fill."""
    B, T, H, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty(B, H, T, device=q.device, dtype=torch.float32))


def selected_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel_idx: torch.Tensor,
                           sel_block_size: int, sm_scale: float, cu_seqlens: torch.Tensor | None = None,
                           cu_seqlens_q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, H, D] in q's dtype, lse2 [B, H, T] fp32) for the selection sel_idx [B, T, Hkv, n];
    with cu_seqlens (B = 1) its block numbers count from each query's document start (and with
    cu_seqlens_q each document's queries are its last ones)."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    G = H // HKV
    num_sel = sel_idx.shape[-1]
    o, lse2 = forward_outputs(q)
    if B * T * H == 0:
        return o, lse2
    tiles = tile_configs.tiles("selected_fwd", head_block(D), q.element_size())
    block_k = tile_configs.key_tile(sel_block_size, tiles.keys)
    _selected_attn_fwd_kernel[flat_grid(T, B * HKV)](
        q, k, v, sel_idx, o, lse2, query_documents(cu_seqlens, cu_seqlens_q, T),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), sel_idx.stride(0), sel_idx.stride(1), sel_idx.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        T, H, HKV, G, num_sel, sel_block_size, sm_scale * LOG2E,
        D=D, BLOCK_D=head_block(D), BLOCK_G=max(16, next_pow2(G)), BLOCK_K=block_k,
        SUB_BLOCKS=cdiv(sel_block_size, block_k), PRECISION=dot_precision(q.dtype), PACKED=cu_seqlens is not None,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return o, lse2
