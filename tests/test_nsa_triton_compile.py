"""The Triton NSA ops under torch.compile: registered custom ops, no graph breaks, same numbers.

On a machine without a GPU the ops run their kernels under Triton's interpreter on CPU tensors;
tracing only ever sees the fake (meta) kernels.
"""

import pytest
import torch

from components.nsa import nsa_attention, num_compressed_blocks
from components.nsa.triton import nsa_attention_triton, ops
from components.nsa.triton.launch import interpreting

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()),
    reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, HKV, D = 1, 37, 4, 2, 16
HYPER = dict(block_size=8, block_stride=4, sel_block_size=8, num_selected=3, window_size=9)


def _inputs():
    Tc = num_compressed_blocks(T, HYPER["block_size"], HYPER["block_stride"])
    shapes = [(B, T, H, D), (B, Tc, HKV, D), (B, Tc, HKV, D)] + [(B, T, HKV, D)] * 4
    xs = [torch.randn(*s, device=DEVICE) for s in shapes] + [torch.rand(B, T, H, 3, device=DEVICE)]
    return [x.requires_grad_() for x in xs]


def _loss_and_grads(fn, xs, grad_out):
    out = fn(*xs)
    return [out.detach()] + list(torch.autograd.grad(out, xs, grad_out))


def _via_dispatcher(*xs):
    return nsa_attention(*xs, **HYPER, backend="triton")


def _direct(*xs):
    return nsa_attention_triton(*xs, **HYPER)


@pytest.mark.parametrize("fn", [_direct, _via_dispatcher], ids=["nsa_attention_triton", "nsa_attention"])
def test_no_graph_breaks(fn):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*_inputs())
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_fullgraph_compile_forward_and_backward_match_eager(backend):
    torch._dynamo.reset()
    xs = _inputs()
    grad_out = torch.randn(B, T, H, D, device=DEVICE)
    eager = _loss_and_grads(_direct, xs, grad_out)
    compiled = _loss_and_grads(torch.compile(_direct, fullgraph=True, backend=backend), xs, grad_out)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_custom_ops_pass_opcheck():
    """Schema, fake kernels, autograd registration and dynamic-shape tracing of every op."""
    q = torch.randn(B, 21, H, D, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, 21, HKV, D, device=DEVICE, requires_grad=True) for _ in range(2))
    k_cmp = torch.randn(B, 4, HKV, D, device=DEVICE)
    scale = D**-0.5
    torch.library.opcheck(ops.interval_attention, (q, k, v, 1, 0, 5, scale))
    _, lse2 = ops.interval_attention(q.detach(), k_cmp, k_cmp, 4, 7, 0, scale)
    selection = ops.select_blocks(q.detach(), k_cmp, lse2, 8, 4, 8, 2, scale)
    torch.library.opcheck(ops.select_blocks, (q.detach(), k_cmp, lse2, 8, 4, 8, 2, scale))
    torch.library.opcheck(ops.selected_attention, (q, k, v, selection, 8, scale))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse2 = ops.interval_attention(qd, kd, vd, 1, 0, 5, scale)
    torch.library.opcheck(ops.interval_attention_backward, (torch.randn_like(o), qd, kd, vd, o, lse2, 1, 0, 5, scale))
    o, lse2 = ops.selected_attention(qd, kd, vd, selection, 8, scale)
    torch.library.opcheck(ops.selected_attention_backward,
                          (torch.randn_like(o), qd, kd, vd, o, lse2, selection, 8, scale))
