"""The exact NSA reference in PyTorch: three branches, gated (NSA_SPEC.md).

Inputs are assumed validated (components.nsa.op does that). Softmax statistics and branch
outputs are computed in fp32 (fp64 for fp64 inputs); the result comes back in q's dtype. Every
function takes queries at absolute positions q_start .. q_start + Tq - 1 and keys at 0 .. Tk - 1.
"""

from __future__ import annotations

import torch

from components.nsa.chunked_attention import chunked_attention, key_layout, query_chunk_size, query_layout
from components.nsa.masks import CompressedRule, SelectedRule, WindowRule
from components.nsa.precision import without_autocast
from components.nsa.selection import score_dtype, select_blocks_at_reference


def _heads_out(o: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, Tq, G, D] -> [B, Tq, H, D]."""
    B, Hkv, Tq, G, D = o.shape
    return o.permute(0, 2, 1, 3, 4).reshape(B, Tq, Hkv * G, D).contiguous()


def compressed_plan(qh, k_cmp, v_cmp, *, block_size: int, block_stride: int) -> tuple:
    """(k, v, visibility rule, keys one query can span) of the compressed branch."""
    return k_cmp, v_cmp, CompressedRule(block_size, block_stride, k_cmp.shape[1], qh.device), max(1, k_cmp.shape[1])


def selected_plan(qh, k_sel, v_sel, selection, *, q_start: int, sel_block_size: int) -> tuple:
    return k_sel, v_sel, SelectedRule(selection, sel_block_size, q_start), k_sel.shape[1]


def window_plan(qh, k_win, v_win, *, window_size: int, window_start: int = 0) -> tuple:
    """window_start: the position of k_win's first key."""
    return k_win, v_win, WindowRule(window_size, qh.device, window_start), min(k_win.shape[1], window_size + 64)


def branch_plans(qh, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, selection, *, q_start: int, block_size: int,
                 block_stride: int, sel_block_size: int, window_size: int, window_start: int = 0) -> list[tuple]:
    """The compressed, selected and window branches' plans, in the gates' order."""
    return [compressed_plan(qh, k_cmp, v_cmp, block_size=block_size, block_stride=block_stride),
            selected_plan(qh, k_sel, v_sel, selection, q_start=q_start, sel_block_size=sel_block_size),
            window_plan(qh, k_win, v_win, window_size=window_size, window_start=window_start)]


def branch_chunk(qh: torch.Tensor, key_span: int) -> int:
    """Queries per chunk for a branch whose queries see at most key_span keys."""
    B, Hkv, Tq, G, _ = qh.shape
    return query_chunk_size(B, Hkv * G, key_span, Tq)


def _attend(qh: torch.Tensor, plan: tuple, q_start: int) -> torch.Tensor:
    k, v, rule, key_span = plan
    return chunked_attention(qh, key_layout(k, qh.dtype), key_layout(v, qh.dtype), rule, q_start,
                             branch_chunk(qh, key_span))


def compressed_attention(q, k_cmp, v_cmp, *, q_start: int, block_size: int, block_stride: int) -> torch.Tensor:
    """o_cmp [B, Tq, H, D] in the compute dtype; a query that sees no compressed block gets 0."""
    qh = query_layout(q, k_cmp.shape[2], score_dtype(q.dtype))
    return _heads_out(_attend(qh, compressed_plan(qh, k_cmp, v_cmp, block_size=block_size,
                                                  block_stride=block_stride), q_start))


def selected_attention(q, k_sel, v_sel, selection, *, q_start: int, sel_block_size: int) -> torch.Tensor:
    """o_sel [B, Tq, H, D]: attention over the tokens s <= t of the blocks in `selection` [B, Tq, Hkv, n]."""
    qh = query_layout(q, k_sel.shape[2], score_dtype(q.dtype))
    return _heads_out(_attend(qh, selected_plan(qh, k_sel, v_sel, selection, q_start=q_start,
                                                sel_block_size=sel_block_size), q_start))


def window_attention(q, k_win, v_win, *, q_start: int, window_size: int) -> torch.Tensor:
    """o_win [B, Tq, H, D]: attention over keys max(0, t - w + 1) <= s <= t."""
    qh = query_layout(q, k_win.shape[2], score_dtype(q.dtype))
    return _heads_out(_attend(qh, window_plan(qh, k_win, v_win, window_size=window_size), q_start))


@without_autocast
def nsa_attention_at_reference(
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, q_start: int,
    block_size: int, block_stride: int, sel_block_size: int, num_selected: int, window_size: int,
    window_start: int = 0,
) -> torch.Tensor:
    """o [B, Tq, H, D] = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win, in q's dtype (k_win / v_win hold the
    keys from position window_start on)."""
    selection = select_blocks_at_reference(
        q, k_cmp, q_start=q_start, block_size=block_size, block_stride=block_stride,
        sel_block_size=sel_block_size, num_selected=num_selected,
    )
    Hkv = k_sel.shape[2]
    qh = query_layout(q, Hkv, score_dtype(q.dtype))
    plans = branch_plans(qh, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, selection, q_start=q_start,
                         block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                         window_size=window_size, window_start=window_start)
    o_cmp, o_sel, o_win = (_attend(qh, plan, q_start) for plan in plans)
    # Gate in the branches' own layout [B, Hkv, Tq, G, D], then one transpose back.
    B, Tq, H, _ = gates.shape
    g = gates.to(qh.dtype).reshape(B, Tq, Hkv, H // Hkv, 3).permute(0, 2, 1, 3, 4).unsqueeze(-1)
    out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_sel + g[..., 2, :] * o_win
    return _heads_out(out).to(q.dtype)
