"""Packed documents on the Triton backend, one document (or one batch of equal-length documents) at a
time: the kernels run on each document's own slices, exactly as for unpacked rows.

One opaque custom op for the whole packed call, so torch.compile sees one node whatever the
boundaries (they are data). Its backward recomputes each document's branch outputs and runs the
kernels' backward ops on them (autograd does not run inside a custom op): one more forward than the
unpacked path, and deterministic like it.
"""

from __future__ import annotations

import torch

from components.nsa.documents import ATTENTION_INPUT_KINDS, TOKEN, per_document
from components.nsa.triton import ops

Tensor = torch.Tensor


def _hyper(block_size, block_stride, sel_block_size, num_selected, window_size) -> dict:
    return dict(block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                num_selected=num_selected, window_size=window_size)


@torch.library.custom_op("nsa_triton::packed_attention", mutates_args=())
def packed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
                     v_win: Tensor, gates: Tensor, block_size: int, block_stride: int, sel_block_size: int,
                     num_selected: int, window_size: int, cu_seqlens: Tensor) -> Tensor:
    from components.nsa.triton.api import attention_on_checked_inputs

    hyper = _hyper(block_size, block_stride, sel_block_size, num_selected, window_size)
    with torch.no_grad():
        o = per_document(lambda *x: attention_on_checked_inputs(*x, **hyper),
                         (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates), ATTENTION_INPUT_KINDS, cu_seqlens,
                         block_size, block_stride)
    return o.contiguous()


@packed_attention.register_fake
def _(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_size, block_stride, sel_block_size, num_selected,
      window_size, cu_seqlens):
    return q.new_empty((*q.shape[:3], v_sel.shape[-1]))


@torch.library.custom_op("nsa_triton::packed_attention_backward", mutates_args=())
def packed_attention_backward(grad_o: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor,
                              k_win: Tensor, v_win: Tensor, gates: Tensor, block_size: int, block_stride: int,
                              sel_block_size: int, num_selected: int, window_size: int,
                              cu_seqlens: Tensor) -> list[Tensor]:
    hyper = _hyper(block_size, block_stride, sel_block_size, num_selected, window_size)

    def one(grad, *inputs):
        return _backward_one(grad, *inputs, **hyper)

    grads = per_document(one, (grad_o, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates),
                         (TOKEN, *ATTENTION_INPUT_KINDS), cu_seqlens, block_size, block_stride)
    return [g.contiguous() for g in grads]


def _backward_one(grad_o, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size: int, block_stride: int,
                  sel_block_size: int, num_selected: int, window_size: int) -> list[Tensor]:
    """The gradients of api.attention_on_checked_inputs for one document: its three branches again,
    then each branch kernel's backward, with the gating done by hand as autograd would."""
    dtype = q.dtype
    originals = (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win)
    k_cmp, v_cmp, k_sel, v_sel, k_win, v_win = (x.to(dtype) for x in originals)
    sm_scale = q.shape[-1] ** -0.5
    cmp_mask, win_mask = (block_stride, block_size - 1, 0, sm_scale), (1, 0, window_size, sm_scale)
    o_cmp, lse_cmp = ops.interval_attention(q, k_cmp, v_cmp, *cmp_mask)
    selection = ops.select_blocks(q, k_cmp, lse_cmp, block_size, block_stride, sel_block_size, num_selected, sm_scale)
    o_sel, lse_sel = ops.selected_attention(q, k_sel, v_sel, selection, sel_block_size, sm_scale)
    o_win, lse_win = ops.interval_attention(q, k_win, v_win, *win_mask)

    go, g = grad_o.float(), gates.float()
    branches = (o_cmp, o_sel, o_win)
    dgates = torch.stack([(go * o.float()).sum(dim=-1) for o in branches], dim=-1).to(gates.dtype)
    d_cmp, d_sel, d_win = ((go * g[..., i:i + 1]).to(dtype) for i in range(3))
    dq_c, dk_cmp, dv_cmp = ops.interval_attention_backward(d_cmp, q, k_cmp, v_cmp, o_cmp, lse_cmp, *cmp_mask)
    dq_s, dk_sel, dv_sel = ops.selected_attention_backward(d_sel, q, k_sel, v_sel, o_sel, lse_sel, selection,
                                                           sel_block_size, sm_scale)
    dq_w, dk_win, dv_win = ops.interval_attention_backward(d_win, q, k_win, v_win, o_win, lse_win, *win_mask)
    dkv = (dk_cmp, dv_cmp, dk_sel, dv_sel, dk_win, dv_win)
    return [dq_c + dq_s + dq_w, *(d.to(x.dtype) for d, x in zip(dkv, originals)), dgates]


@packed_attention_backward.register_fake
def _(grad_o, q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_size, block_stride, sel_block_size,
      num_selected, window_size, cu_seqlens):
    return [x.new_empty(x.shape) for x in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8], inputs[13])
    ctx.hyperparameters = inputs[8:13]


def _backward(ctx, grad_o):
    *tensors, cu_seqlens = ctx.saved_tensors
    grads = packed_attention_backward(grad_o, *tensors, *ctx.hyperparameters, cu_seqlens)
    return (*grads, None, None, None, None, None, None)


packed_attention.register_autograd(_backward, setup_context=_setup_context)
