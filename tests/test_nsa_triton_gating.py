"""The Triton gating op (the gated sum of the three branches) against the same sum in torch ops, forward
and gradients, and against torch.library.opcheck."""

from __future__ import annotations

import pytest
import torch

from components.nsa.triton.launch import interpreting

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()),
    reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _branches(B, T, H, D, dtype, gates_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outs = [torch.randn(B, T, H, D, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(3)]
    gates = torch.rand(B, T, H, 3, generator=gen).to(DEVICE, gates_dtype).requires_grad_()
    return outs, gates


def _torch_gate(o_cmp, o_sel, o_win, gates):
    """The sum as torch ops: fp32, stored in the branches' dtype."""
    g = gates.float().unsqueeze(-1)
    return (g[..., 0, :] * o_cmp.float() + g[..., 1, :] * o_sel.float() + g[..., 2, :] * o_win.float()).to(o_cmp.dtype)


@pytest.mark.parametrize("shape", [(2, 7, 3, 16), (1, 40, 2, 24), (1, 3, 1, 128)], ids=str)
@pytest.mark.parametrize("dtype, gates_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32),
    pytest.param(torch.bfloat16, torch.bfloat16, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="bf16 as training runs it, on a GPU (the interpreter's bf16 is not)")),
], ids=str)
def test_gate_equals_the_sum_in_torch_ops(shape, dtype, gates_dtype):
    from components.nsa.triton import ops

    (outs, gates), (ref_outs, ref_gates) = (_branches(*shape, dtype, gates_dtype) for _ in range(2))
    got = ops.gate(*outs, gates)
    want = _torch_gate(*ref_outs, ref_gates)
    assert got.dtype == dtype and got.shape == want.shape
    # fp32 sums of three products: the kernel may fuse a multiply-add where torch rounds between them.
    tol = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=2e-3, rtol=2e-3),
           torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]  # about one unit in the last place
    torch.testing.assert_close(got, want, **tol)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    got_grads = torch.autograd.grad(got, [*outs, gates], grad)
    want_grads = torch.autograd.grad(want, [*ref_outs, ref_gates], grad)
    for name, g, w in zip(("d_cmp", "d_sel", "d_win", "d_gates"), got_grads, want_grads):
        assert g.dtype == w.dtype, name
        if name != "d_gates":
            torch.testing.assert_close(g, w, **tol, msg=name)
    _assert_gate_grads_within_the_fp32_sum_bound(got_grads[3], grad, outs)


def _assert_gate_grads_within_the_fp32_sum_bound(d_gates, grad, outs):
    """Each gate's gradient is a sum over the head dimension (D products), which the kernel and torch add in
    different orders: compare with the exact sum (fp64) within the textbook bound of an fp32 sum of D terms,
    D * 2^-24 * sum |term|, plus the rounding of the result to the gates' dtype."""
    D = grad.shape[-1]
    terms = torch.stack([grad.double() * o.detach().double() for o in outs], dim=-2)  # (..., 3, D)
    exact = terms.sum(-1)
    unit = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[d_gates.dtype]
    bound = D * 2.0 ** -24 * terms.abs().sum(-1) + unit * exact.abs() + torch.finfo(d_gates.dtype).tiny
    err = (d_gates.double() - exact).abs()
    assert bool((err <= bound).all()), f"d_gates off the exact sum by {(err / bound).max().item():.2f}x the bound"


def test_gate_takes_strided_inputs_and_empty_ones():
    from components.nsa.triton import ops

    outs, gates = _branches(1, 5, 2, 8, torch.float32, torch.float32)
    wide = torch.randn(1, 5, 2, 24, device=DEVICE)
    wide[..., 8:16] = outs[1].detach()
    strided = wide[..., 8:16]
    gates_t = gates.detach().transpose(1, 2).contiguous().transpose(1, 2)  # same values, another layout
    torch.testing.assert_close(ops.gate(outs[0], strided, outs[2], gates_t), _torch_gate(*outs, gates))
    empty = [torch.zeros(1, 0, 2, 8, device=DEVICE) for _ in range(3)]
    assert ops.gate(*empty, torch.zeros(1, 0, 2, 3, device=DEVICE)).shape == (1, 0, 2, 8)


def test_gate_ops_pass_opcheck():
    from components.nsa.triton import ops

    outs, gates = _branches(2, 5, 3, 16, torch.float32, torch.float32)
    torch.library.opcheck(ops.gate, (*outs, gates))
    grad = torch.randn(2, 5, 3, 16, device=DEVICE)
    torch.library.opcheck(ops.gate_backward, (grad, *(x.detach() for x in outs), gates.detach()))
