"""NSA with Triton kernels: the same function as the reference (NSA_SPEC.md), only faster.

Forward: the compressed branch (with its log-sum-exp) -> block selection from that log-sum-exp
-> selected attention -> window attention -> gates. The branch outputs are gated in fp32 by a
custom op of its own (gating.py), whose backward gives the gate gradients and each branch's share
of dO, which autograd routes into that branch op's backward. Selection is discrete: its inputs are
detached.
cu_seqlens (packed documents, B = 1) goes to every op: each document is computed on its own.
"""

from __future__ import annotations

import torch

from components.nsa.checks import check_attention_call, check_selection_call
from components.nsa.triton import ops
from components.nsa.triton.launch import check_head_dim, check_kernel_device, check_kernel_dtype


def _check_kernel_inputs(q: torch.Tensor) -> None:
    check_kernel_device(q)
    check_kernel_dtype(q)
    check_head_dim(q.shape[-1])


def nsa_attention_triton(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size: int, block_stride: int,
                         sel_block_size: int, num_selected: int, window_size: int,
                         cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """o [B, T, H, D] in q's dtype; shapes and semantics (cu_seqlens and the max_seqlen hint included) as
    components.nsa.nsa_attention, inputs checked."""
    hyper = dict(block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                 num_selected=num_selected, window_size=window_size)
    check_attention_call(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=0, cu_seqlens=cu_seqlens,
                         **hyper)
    return attention_on_checked_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, cu_seqlens=cu_seqlens,
                                       max_seqlen=max_seqlen, **hyper)


def attention_on_checked_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size: int,
                                block_stride: int, sel_block_size: int, num_selected: int, window_size: int,
                                cu_seqlens: torch.Tensor | None = None,
                                cu_seqlens_q: torch.Tensor | None = None,
                                max_seqlen: int | None = None) -> torch.Tensor:
    """The backend table's entry: the op (components.nsa.op) has checked the call; only what the
    kernels need beyond the op's contract (device, dtype, head dim) is checked here. max_seqlen (a bound
    on the documents' lengths) picks the selected branch's layout, nothing else."""
    _check_kernel_inputs(q)
    # tl.dot wants one dtype per product; a no-op (and no copy) in the usual all-same case.
    k_cmp, v_cmp, k_sel, v_sel, k_win, v_win = (x.to(q.dtype) for x in (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win))
    sm_scale = q.shape[-1] ** -0.5

    docs = (cu_seqlens, cu_seqlens_q)
    o_cmp, lse2_cmp = ops.interval_attention(q, k_cmp, v_cmp, block_stride, block_size - 1, 0, sm_scale, *docs)
    selection = ops.select_blocks(q.detach(), k_cmp.detach(), lse2_cmp.detach(), block_size, block_stride,
                                  sel_block_size, num_selected, sm_scale, *docs)
    o_sel, _ = ops.selected_attention(q, k_sel, v_sel, selection, sel_block_size, sm_scale, *docs, max_seqlen)
    o_win, _ = ops.interval_attention(q, k_win, v_win, 1, 0, window_size, sm_scale, *docs)

    return ops.gate(o_cmp, o_sel, o_win, gates)  # in fp32, stored in q's dtype (the branches')


@torch.no_grad()
def select_blocks_triton(q, k_cmp, *, block_size: int, block_stride: int, sel_block_size: int,
                         num_selected: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """LongTensor [B, T, Hkv, n], ascending, -1 for unused slots; as components.nsa.select_blocks
    (with cu_seqlens, block numbers count from each query's document start)."""
    check_selection_call(q, k_cmp, q_start=0, block_size=block_size, block_stride=block_stride,
                         sel_block_size=sel_block_size, num_selected=num_selected, cu_seqlens=cu_seqlens)
    _check_kernel_inputs(q)
    k_cmp = k_cmp.to(q.dtype)
    sm_scale = q.shape[-1] ** -0.5
    # Only the log-sum-exp of the compressed branch is needed; k_cmp stands in for v_cmp.
    _, lse2_cmp = ops.interval_attention(q, k_cmp, k_cmp, block_stride, block_size - 1, 0, sm_scale, cu_seqlens)
    return ops.select_blocks(q, k_cmp, lse2_cmp, block_size, block_stride, sel_block_size, num_selected, sm_scale,
                             cu_seqlens)
