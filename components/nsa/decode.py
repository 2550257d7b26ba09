"""NSA for one query against every key before it: the decode step, reading only what each branch sees.

The reference (reference.py) lays every branch's keys out whole and masks what a query cannot see; for one
query at the end of a long cache that copies the whole cache each step. Here the selected branch gathers
the tokens of its chosen blocks and the window branch slices its last w keys, so beyond scoring the
compressed keys a step's cost does not grow with the context; the compressed branch's probabilities are
computed once for the branch and for selection. The same numbers as the reference up to float rounding:
the sums run over the same nonzero terms, in another order.
"""

from __future__ import annotations

import torch

from components.nsa.chunked_attention import key_layout, query_layout
from components.nsa.hyperparams import num_selection_blocks
from components.nsa.masks import additive
from components.nsa.precision import without_autocast
from components.nsa.selection import score_dtype, spread_over_selection_blocks, top_blocks


def _attend(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(qh k^T + bias) v: qh [B, Hkv, G, D] pre-scaled, k and v [B, Hkv, K, D], bias [B, Hkv, 1, K]."""
    scores = torch.matmul(qh, k.transpose(-1, -2))
    if bias is not None:
        scores.add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _selected_tokens(k_sel: torch.Tensor, v_sel: torch.Tensor, chosen: torch.Tensor, position: int,
                     sel_block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values [B, Hkv, n * l', D] of the chosen blocks' tokens (chosen [B, Hkv, n], -1 unused) and
    the additive mask [B, Hkv, 1, n * l'] hiding unused slots and the current block's tokens after `position`."""
    B, Hkv, _ = chosen.shape
    device = chosen.device
    tokens = (chosen[..., None] * sel_block_size + torch.arange(sel_block_size, device=device)).flatten(2)
    keep = (tokens >= 0) & (tokens <= position)  # an unused slot (-1) gives negative tokens
    tokens = tokens.clamp(0, position)  # hidden tokens read a real row, masked out below
    rows = torch.arange(B, device=device)[:, None, None]
    groups = torch.arange(Hkv, device=device)[None, :, None]
    k, v = k_sel[rows, tokens, groups].to(dtype), v_sel[rows, tokens, groups].to(dtype)
    return k, v, additive(keep, dtype)[:, :, None, :]


def _compressed_and_scores(qh: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, num_sel_blocks: int,
                           block_size: int, block_stride: int, sel_block_size: int) -> tuple[torch.Tensor, ...]:
    """(o_cmp [B, Hkv, G, D], group scores [B, Hkv, Ts]) from one softmax over the compressed keys: the
    branch's probabilities are those selection ranks by (every complete block ends at or before the query)."""
    B, Hkv = qh.shape[:2]
    if k_cmp.shape[1] == 0:  # no block yet: output 0, every score 0 (the forced blocks decide)
        return qh.new_zeros(qh.shape[:3] + (v_cmp.shape[-1],)), qh.new_zeros(B, Hkv, num_sel_blocks)
    probs = torch.softmax(torch.matmul(qh, key_layout(k_cmp, qh.dtype).transpose(-1, -2)), dim=-1)
    group = probs.detach().sum(dim=2)  # selection carries no gradient
    scores = spread_over_selection_blocks(group, num_sel_blocks, block_size, block_stride, sel_block_size)
    return torch.matmul(probs, key_layout(v_cmp, qh.dtype)), scores


@without_autocast
def nsa_attention_one_query(
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, q_start: int,
    block_size: int, block_stride: int, sel_block_size: int, num_selected: int, window_size: int,
    window_start: int = 0,
) -> torch.Tensor:
    """o [B, 1, H, D] in q's dtype for the query q [B, 1, H, D] at position q_start; the selection keys and
    values hold positions 0 .. q_start, the window's window_start .. q_start, k_cmp / v_cmp the complete
    compressed blocks (inputs validated)."""
    B, _, H, _ = q.shape
    Hkv = k_sel.shape[2]
    dtype = score_dtype(q.dtype)
    qh = query_layout(q, Hkv, dtype)[:, :, 0]  # [B, Hkv, G, D]
    o_cmp, scores = _compressed_and_scores(qh, k_cmp, v_cmp, num_selection_blocks(q_start + 1, sel_block_size),
                                           block_size, block_stride, sel_block_size)
    chosen = top_blocks(scores[:, None], q_start=q_start, sel_block_size=sel_block_size,
                        num_selected=num_selected)[:, 0]
    o_sel = _attend(qh, *_selected_tokens(k_sel, v_sel, chosen, q_start, sel_block_size, dtype))
    first = max(0, q_start - window_size + 1) - window_start
    o_win = _attend(qh, key_layout(k_win[:, first:], dtype), key_layout(v_win[:, first:], dtype))
    g = gates.to(dtype).reshape(B, Hkv, H // Hkv, 3, 1)
    out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_sel + g[..., 2, :] * o_win
    return out.reshape(B, 1, H, -1).to(q.dtype)
