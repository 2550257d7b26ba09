"""The NSA Triton kernels as torch.library custom ops, with fake (meta) kernels and autograd.

torch.compile treats each op as one opaque node: the fake kernels give it output shapes without
running anything, so a compiled model calling nsa_attention_triton has no graph break, and the
backward ops appear in the compiled backward graph the same way. Every output is freshly
allocated and contiguous, matching the fake kernels.

    nsa_triton::interval_attention(q, k, v, key_stride, key_offset, window, sm_scale, cu_seqlens) -> (o, lse2)
    nsa_triton::select_blocks(q, k_cmp, lse2_cmp, block_size, block_stride, sel_block_size,
                              num_selected, sm_scale, cu_seqlens) -> LongTensor [B, T, Hkv, n]
    nsa_triton::selected_attention(q, k, v, sel_idx, sel_block_size, sm_scale, cu_seqlens, cu_seqlens_q,
                                   max_seqlen) -> (o, lse2): max_seqlen, a bound on the documents' lengths,
                                   only picks the layout (tile_configs.selected_layout_for)
    nsa_triton::gate(o_cmp, o_sel, o_win, gates) -> o: the gated sum of the branches (gating.py)
and the backward ops. lse2 outputs carry no gradient. cu_seqlens (optional, B = 1): packed
documents, each computed on its own (NSA_SPEC.md section 4); the ops derive their tables from it
on the device, so its values never enter the graph and moving boundaries recompile nothing.
cu_seqlens_q (optional, with cu_seqlens): each document's queries are its last ones (context parallelism).
"""

from __future__ import annotations

from typing import Optional

import torch

from components.nsa.triton import tile_configs
from components.nsa.triton.gating import gate_bwd, gate_fwd
from components.nsa.triton.interval_attention import interval_attention_bwd, interval_attention_fwd
from components.nsa.triton.launch import last_dim_contiguous
from components.nsa.triton.selected_attention_bwd import selected_attention_bwd
from components.nsa.triton.selected_attention_fwd import selected_attention_fwd
from components.nsa.triton.selected_attention_fwd_blocks import selected_attention_fwd_blocks
from components.nsa.triton.selected_attention_masked import selected_attention_bwd_masked, selected_attention_fwd_masked
from components.nsa.triton.selection_kernel import select_blocks_kernel

Tensor = torch.Tensor


def _dense(*tensors: Tensor) -> list[Tensor]:
    return [last_dim_contiguous(x) for x in tensors]


def _lse_like(q: Tensor) -> Tensor:
    B, T, H, _ = q.shape
    return q.new_empty((B, H, T), dtype=torch.float32)


# ---- compressed and window branches ------------------------------------------------------------

@torch.library.custom_op("nsa_triton::interval_attention", mutates_args=())
def interval_attention(q: Tensor, k: Tensor, v: Tensor, key_stride: int, key_offset: int, window: int,
                       sm_scale: float, cu_seqlens: Optional[Tensor] = None,
                       cu_seqlens_q: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    q, k, v = _dense(q, k, v)
    return interval_attention_fwd(q, k, v, key_stride, key_offset, window, sm_scale, cu_seqlens, cu_seqlens_q)


@interval_attention.register_fake
def _interval_attention_fake(q, k, v, key_stride, key_offset, window, sm_scale, cu_seqlens=None, cu_seqlens_q=None):
    return q.new_empty(q.shape), _lse_like(q)


@torch.library.custom_op("nsa_triton::interval_attention_backward", mutates_args=())
def interval_attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse2: Tensor,
                                key_stride: int, key_offset: int, window: int, sm_scale: float,
                                cu_seqlens: Optional[Tensor] = None,
                                cu_seqlens_q: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    do, q, k, v, o = _dense(do, q, k, v, o)
    return interval_attention_bwd(do, q, k, v, o, lse2, key_stride, key_offset, window, sm_scale, cu_seqlens,
                                  cu_seqlens_q)


@interval_attention_backward.register_fake
def _interval_attention_backward_fake(do, q, k, v, o, lse2, key_stride, key_offset, window, sm_scale,
                                      cu_seqlens=None, cu_seqlens_q=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _interval_setup(ctx, inputs, output):
    q, k, v, key_stride, key_offset, window, sm_scale, cu_seqlens, cu_seqlens_q = inputs
    o, lse2 = output
    ctx.save_for_backward(q, k, v, o, lse2, cu_seqlens, cu_seqlens_q)
    ctx.mask = (key_stride, key_offset, window, sm_scale)
    ctx.mark_non_differentiable(lse2)


def _interval_backward(ctx, do, _dlse2):
    q, k, v, o, lse2, cu_seqlens, cu_seqlens_q = ctx.saved_tensors
    dq, dk, dv = interval_attention_backward(do, q, k, v, o, lse2, *ctx.mask, cu_seqlens, cu_seqlens_q)
    return dq, dk, dv, None, None, None, None, None, None


interval_attention.register_autograd(_interval_backward, setup_context=_interval_setup)


# ---- selection ---------------------------------------------------------------------------------

@torch.library.custom_op("nsa_triton::select_blocks", mutates_args=())
def select_blocks(q: Tensor, k_cmp: Tensor, lse2_cmp: Tensor, block_size: int, block_stride: int,
                  sel_block_size: int, num_selected: int, sm_scale: float,
                  cu_seqlens: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None) -> Tensor:
    q, k_cmp = _dense(q, k_cmp)
    return select_blocks_kernel(q, k_cmp, lse2_cmp.contiguous(), block_size=block_size, block_stride=block_stride,
                                sel_block_size=sel_block_size, num_selected=num_selected, sm_scale=sm_scale,
                                cu_seqlens=cu_seqlens, cu_seqlens_q=cu_seqlens_q)


@select_blocks.register_fake
def _select_blocks_fake(q, k_cmp, lse2_cmp, block_size, block_stride, sel_block_size, num_selected, sm_scale,
                        cu_seqlens=None, cu_seqlens_q=None):
    B, T = q.shape[0], q.shape[1]
    return q.new_empty((B, T, k_cmp.shape[2], num_selected), dtype=torch.int64)


# ---- selected branch ---------------------------------------------------------------------------

@torch.library.custom_op("nsa_triton::selected_attention", mutates_args=())
def selected_attention(q: Tensor, k: Tensor, v: Tensor, sel_idx: Tensor, sel_block_size: int,
                       sm_scale: float, cu_seqlens: Optional[Tensor] = None,
                       cu_seqlens_q: Optional[Tensor] = None,
                       max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor]:
    q, k, v = _dense(q, k, v)
    layout = _selected_layout(q, k, sel_idx, sel_block_size, max_seqlen)
    forward = {"query": selected_attention_fwd, "block": selected_attention_fwd_blocks,
               "masked": selected_attention_fwd_masked}[layout]
    return forward(q, k, v, sel_idx.contiguous(), sel_block_size, sm_scale, cu_seqlens, cu_seqlens_q)


def _selected_layout(q: Tensor, k: Tensor, sel_idx: Tensor, sel_block_size: int, max_seqlen: Optional[int]) -> str:
    """tile_configs.selected_layout_for this call: its rows' keys are k's, or at most max_seqlen a document."""
    B, T, H, D = q.shape
    row_keys = k.shape[1] if max_seqlen is None else min(k.shape[1], max_seqlen)
    return tile_configs.selected_layout_for(B * T, H, k.shape[2], sel_idx.shape[-1], D, sel_block_size,
                                            q.element_size(), row_keys=row_keys)


@selected_attention.register_fake
def _selected_attention_fake(q, k, v, sel_idx, sel_block_size, sm_scale, cu_seqlens=None, cu_seqlens_q=None,
                             max_seqlen=None):
    return q.new_empty(q.shape), _lse_like(q)


@torch.library.custom_op("nsa_triton::selected_attention_backward", mutates_args=())
def selected_attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse2: Tensor,
                                sel_idx: Tensor, sel_block_size: int, sm_scale: float,
                                cu_seqlens: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                                max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    do, q, k, v, o = _dense(do, q, k, v, o)
    layout = _selected_layout(q, k, sel_idx, sel_block_size, max_seqlen)
    if layout == "masked":
        return selected_attention_bwd_masked(do, q, k, v, o, lse2, sel_idx.contiguous(), sel_block_size, sm_scale,
                                             cu_seqlens, cu_seqlens_q)
    return selected_attention_bwd(do, q, k, v, o, lse2, sel_idx.contiguous(), sel_block_size, sm_scale, cu_seqlens,
                                  cu_seqlens_q, dq_layout=layout)


@selected_attention_backward.register_fake
def _selected_attention_backward_fake(do, q, k, v, o, lse2, sel_idx, sel_block_size, sm_scale, cu_seqlens=None,
                                      cu_seqlens_q=None, max_seqlen=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _selected_setup(ctx, inputs, output):
    q, k, v, sel_idx, sel_block_size, sm_scale, cu_seqlens, cu_seqlens_q, max_seqlen = inputs
    o, lse2 = output
    ctx.save_for_backward(q, k, v, o, lse2, sel_idx, cu_seqlens, cu_seqlens_q)
    ctx.params = (sel_block_size, sm_scale)
    ctx.max_seqlen = max_seqlen
    ctx.mark_non_differentiable(lse2)


def _selected_backward(ctx, do, _dlse2):
    q, k, v, o, lse2, sel_idx, cu_seqlens, cu_seqlens_q = ctx.saved_tensors
    dq, dk, dv = selected_attention_backward(do, q, k, v, o, lse2, sel_idx, *ctx.params, cu_seqlens, cu_seqlens_q,
                                             ctx.max_seqlen)
    return dq, dk, dv, None, None, None, None, None, None


selected_attention.register_autograd(_selected_backward, setup_context=_selected_setup)


# ---- gates -------------------------------------------------------------------------------------

@torch.library.custom_op("nsa_triton::gate", mutates_args=())
def gate(o_cmp: Tensor, o_sel: Tensor, o_win: Tensor, gates: Tensor) -> Tensor:
    return gate_fwd(*(x.contiguous() for x in (o_cmp, o_sel, o_win, gates)))


@gate.register_fake
def _gate_fake(o_cmp, o_sel, o_win, gates):
    return torch.empty_like(o_cmp, memory_format=torch.contiguous_format)


@torch.library.custom_op("nsa_triton::gate_backward", mutates_args=())
def gate_backward(do: Tensor, o_cmp: Tensor, o_sel: Tensor, o_win: Tensor,
                  gates: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return gate_bwd(*(x.contiguous() for x in (do, o_cmp, o_sel, o_win, gates)))


@gate_backward.register_fake
def _gate_backward_fake(do, o_cmp, o_sel, o_win, gates):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (o_cmp, o_sel, o_win, gates))


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gate_backward(ctx, do):
    return gate_backward(do, *ctx.saved_tensors)


gate.register_autograd(_gate_backward, setup_context=_gate_setup)
