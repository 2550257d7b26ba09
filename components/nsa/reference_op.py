"""The reference backend as one opaque torch.library op, forward and backward.

Traced by torch.compile, the reference's Python loops over query chunks would be unrolled (compile
time growing with T / 64) and its chunk bounds would pin every sequence length (a recompile per
length). As a custom op it is one node in the graph with a shape-only fake, and its backward is the
same flash-style recomputation the eager path uses. Every output is contiguous, in the real and the
fake kernels alike: inductor checks the real strides against the fake's promise. The numbers are those of
nsa_attention_at_reference, which the tests hold against brute force.
"""

from __future__ import annotations

from typing import Optional

import torch

from components.nsa.chunked_attention import chunked_attention_backward, chunked_attention_forward, key_layout
from components.nsa.chunked_attention import query_layout
from components.nsa.reference import branch_chunk, branch_plans, nsa_attention_at_reference
from components.nsa.documents import ATTENTION_INPUT_KINDS, QUERY, per_document
from components.nsa.precision import without_autocast
from components.nsa.selection import score_dtype, select_blocks_at_reference

Tensor = torch.Tensor


@torch.library.custom_op("nsa_reference::attention", mutates_args=())
def reference_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor,
                        v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor,
                        block_size: int, block_stride: int, sel_block_size: int, num_selected: int,
                        window_size: int, cu_seqlens: Optional[Tensor] = None,
                        cu_seqlens_q: Optional[Tensor] = None) -> torch.Tensor:
    hyper = dict(block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                 num_selected=num_selected, window_size=window_size)

    def one(*tensors, q_start: int):
        return nsa_attention_at_reference(*tensors, q_start=q_start, **hyper)

    o = per_document(one, (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates), ATTENTION_INPUT_KINDS, cu_seqlens,
                     block_size, block_stride, cu_seqlens_q)
    return o.contiguous()


@reference_attention.register_fake
def _(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_size, block_stride, sel_block_size, num_selected,
      window_size, cu_seqlens=None, cu_seqlens_q=None):
    return torch.empty(*q.shape[:3], v_sel.shape[-1], dtype=q.dtype, device=q.device)


@torch.library.custom_op("nsa_reference::attention_backward", mutates_args=())
def reference_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                                 k_sel: torch.Tensor, v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                                 gates: torch.Tensor, block_size: int, block_stride: int, sel_block_size: int,
                                 num_selected: int, window_size: int, cu_seqlens: Optional[Tensor] = None,
                                 cu_seqlens_q: Optional[Tensor] = None) -> list[torch.Tensor]:
    """[dq, dk_cmp, dv_cmp, dk_sel, dv_sel, dk_win, dv_win, dgates], each in its input's dtype."""
    hyper = dict(block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                 num_selected=num_selected, window_size=window_size)
    grads = per_document(lambda *tensors, q_start: _backward_one(*tensors, q_start=q_start, **hyper),
                         (grad_o, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates),
                         (QUERY, *ATTENTION_INPUT_KINDS), cu_seqlens, block_size, block_stride, cu_seqlens_q)
    return [g.contiguous() for g in grads]


@without_autocast
def _backward_one(grad_o, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, q_start: int, block_size: int,
                  block_stride: int, sel_block_size: int, num_selected: int, window_size: int) -> list[Tensor]:
    """The backward of one sequence (one document; queries from position q_start on) by flash-style
    recomputation."""
    selection = select_blocks_at_reference(q, k_cmp, q_start=q_start, block_size=block_size, block_stride=block_stride,
                                           sel_block_size=sel_block_size, num_selected=num_selected)
    dtype = score_dtype(q.dtype)
    B, T, H, D = q.shape
    Hkv = k_sel.shape[2]
    G = H // Hkv
    qh = query_layout(q, Hkv, dtype)  # [B, Hkv, T, G, D], scaled by 1/sqrt(D)
    g = gates.to(dtype).reshape(B, T, Hkv, G, 3).permute(0, 2, 1, 3, 4)
    go = grad_o.to(dtype).reshape(B, T, Hkv, G, -1).permute(0, 2, 1, 3, 4)
    plans = branch_plans(qh, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, selection, q_start=q_start,
                         block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                         window_size=window_size)
    dqh = torch.zeros_like(qh)
    dgates = []
    dkv = []
    for branch, (k, v, rule, key_span) in enumerate(plans):
        kl, vl = key_layout(k, dtype), key_layout(v, dtype)
        chunk = branch_chunk(qh, key_span)
        out = chunked_attention_forward(qh, kl, vl, rule, q_start, chunk)
        dgates.append((go * out).sum(dim=-1))
        dq_b, dk_b, dv_b = chunked_attention_backward(qh, kl, vl, out, go * g[..., branch:branch + 1], rule, q_start,
                                                    chunk)
        dqh += dq_b
        dkv += [dk_b.permute(0, 2, 1, 3).to(k.dtype), dv_b.permute(0, 2, 1, 3).to(v.dtype)]
    dq = (dqh * D**-0.5).permute(0, 2, 1, 3, 4).reshape(B, T, H, D).to(q.dtype)
    dg = torch.stack(dgates, dim=-1).permute(0, 2, 1, 3, 4).reshape(B, T, H, 3).to(gates.dtype)
    return [dq, *dkv, dg]


@reference_attention_backward.register_fake
def _(grad_o, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_size, block_stride, sel_block_size,
      num_selected, window_size, cu_seqlens=None, cu_seqlens_q=None):
    return [x.new_empty(x.shape) for x in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)]


def _setup_context(ctx, inputs, output):
    packing = tuple(inputs[13:15]) + (None,) * (15 - max(len(inputs), 13))  # (cu_seqlens, cu_seqlens_q)
    ctx.save_for_backward(*inputs[:8], *packing)
    ctx.hyperparameters = inputs[8:13]


def _backward(ctx, grad_o):
    *tensors, cu_seqlens, cu_seqlens_q = ctx.saved_tensors
    grads = reference_attention_backward(grad_o, *tensors, *ctx.hyperparameters, cu_seqlens, cu_seqlens_q)
    return (*grads, None, None, None, None, None, None, None)


reference_attention.register_autograd(_backward, setup_context=_setup_context)
