"""Every NSA custom op against torch.library.opcheck: the fake (meta) kernels promise the sizes, strides,
dtypes and devices the real kernels produce, the schemas and autograd registrations are right.

Inductor checks real strides against the fake's at run time (a wrong promise crashed the compiled
backward), so the inputs include odd lengths and non-contiguous views like the model's own: q, k, v
sliced out of one fused projection, and tensors whose last dim is not dense.
"""

from __future__ import annotations

import pytest
import torch

from components.nsa import num_compressed_blocks
from components.nsa.reference_op import reference_attention, reference_attention_backward
from components.nsa.triton.launch import interpreting
from tests.test_nsa_bruteforce import HYPER_NAMES

pytestmark = pytest.mark.usefixtures("one_thread")

ORDER = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")
# (B, T, H, Hkv, D, l, d, l', n, w): odd lengths, T < l (no compressed block), GQA groups of 1 to 3.
SHAPES = [
    (1, 21, 2, 1, 4, 8, 4, 16, 3, 20),
    (2, 19, 6, 2, 8, 8, 4, 8, 2, 9),
    (2, 5, 3, 3, 16, 8, 4, 8, 2, 4),
]
LAYOUTS = ("contiguous", "fused_projection", "transposed")


def _layout(x: torch.Tensor, layout: str, gen: torch.Generator) -> torch.Tensor:
    """The same values as x in another memory layout (a leaf, so opcheck can take gradients)."""
    if layout == "contiguous" or x.numel() == 0:  # an empty tensor has no layout (and opcheck's copy fails on one)
        return x
    B, T, H, D = x.shape
    if layout == "fused_projection":  # a slice of a wider [B, T, H, 3D] buffer: last dim dense, others strided
        wide = torch.randn(B, T, H, 3 * D, generator=gen, dtype=x.dtype).to(x.device)
        wide[..., D:2 * D] = x
        return wide[..., D:2 * D].detach().requires_grad_(x.requires_grad)
    # stored as [B, H, D, T]: no dim is dense
    return x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2).detach().requires_grad_(x.requires_grad)


def _inputs(shape, layout: str, dtype=torch.float32, requires_grad=True, lengths=None, device="cpu"):
    """The op's inputs for shape on `device`; with document lengths (B = 1), k_cmp / v_cmp hold their blocks."""
    B, T, H, Hkv, D, l, d, lp, n, w = shape
    gen = torch.Generator().manual_seed(T)
    Tc = sum(num_compressed_blocks(length, l, d) for length in (lengths or [T]))
    shapes = dict(q=(B, T, H, D), k_cmp=(B, Tc, Hkv, D), v_cmp=(B, Tc, Hkv, D), k_sel=(B, T, Hkv, D),
                  v_sel=(B, T, Hkv, D), k_win=(B, T, Hkv, D), v_win=(B, T, Hkv, D))
    xs = {name: torch.randn(*s, generator=gen).to(device, dtype) for name, s in shapes.items()}
    xs["gates"] = torch.rand(B, T, H, 3, generator=gen).to(device, dtype)
    out = {}
    for name, x in xs.items():
        x.requires_grad_(requires_grad)
        out[name] = _layout(x, layout, gen)
    return out, dict(zip(HYPER_NAMES, (l, d, lp, n, w), strict=True))


def _id(shape):
    return "B{}_T{}_H{}_Hkv{}_D{}".format(*shape[:5])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_reference_ops(shape, layout):
    xs, hp = _inputs(shape, layout)
    tensors = tuple(xs[n] for n in ORDER)
    hyper = tuple(hp[n] for n in HYPER_NAMES)
    torch.library.opcheck(reference_attention, tensors + hyper)
    grad_o = _layout(torch.randn(*xs["q"].shape), layout, torch.Generator().manual_seed(1))
    torch.library.opcheck(reference_attention_backward, (grad_o.detach(),) + tuple(x.detach() for x in tensors) + hyper)


triton_only = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()),
    reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton ops' (the interpreter's on CPU tensors)


# The interpreter runs each program in Python: the largest shape (B*T = 38) takes the plain layout only.
TRITON_CASES = [(SHAPES[0], layout) for layout in LAYOUTS] + [(SHAPES[2], layout) for layout in LAYOUTS]
TRITON_CASES += [(SHAPES[1], "contiguous")]


@triton_only
@pytest.mark.parametrize("shape, layout", TRITON_CASES, ids=[f"{_id(s)}-{lay}" for s, lay in TRITON_CASES])
def test_triton_ops(shape, layout):
    xs, hp = _inputs(shape, layout, device=DEVICE)
    _opcheck_triton_ops(xs, hp, layout)


@triton_only
def test_triton_ops_with_cu_seqlens():
    """Packed documents (a document of one token, one without a compressed block), strided inputs."""
    lengths = [9, 1, 22]
    xs, hp = _inputs((1, sum(lengths), 2, 1, 8, 8, 4, 8, 2, 6), "fused_projection", lengths=lengths, device=DEVICE)
    _opcheck_triton_ops(xs, hp, "fused_projection", torch.tensor([0, 9, 10, 32], device=DEVICE))


def _opcheck_triton_ops(xs, hp, layout, cu_seqlens=None):
    """opcheck of the five Triton ops, each on inputs made by the ops before it."""
    from components.nsa.triton import ops

    q, k_cmp, v_cmp, k_sel, v_sel = (xs[n] for n in ORDER[:5])
    l, d, lp, n, w = (hp[n] for n in HYPER_NAMES)
    scale = q.shape[-1] ** -0.5
    gen = torch.Generator().manual_seed(2)

    # Compressed branch (key stride d, offset l - 1) and window branch (stride 1, window w).
    for k, v, mask in ((k_cmp, v_cmp, (d, l - 1, 0)), (k_sel, v_sel, (1, 0, w))):
        torch.library.opcheck(ops.interval_attention, (q, k, v, *mask, scale, cu_seqlens))
        o, lse2 = (x.detach() for x in ops.interval_attention(q, k, v, *mask, scale, cu_seqlens))
        do = _layout(torch.randn(*o.shape, generator=gen).to(q.device), layout, gen).detach()
        args = (do, q.detach(), k.detach(), v.detach(), o, lse2, *mask, scale, cu_seqlens)
        torch.library.opcheck(ops.interval_attention_backward, args)

    _, lse2_cmp = ops.interval_attention(q.detach(), k_cmp.detach(), k_cmp.detach(), d, l - 1, 0, scale, cu_seqlens)
    args = (q.detach(), k_cmp.detach(), lse2_cmp, l, d, lp, n, scale, cu_seqlens)
    torch.library.opcheck(ops.select_blocks, args)

    selection = ops.select_blocks(*args)
    torch.library.opcheck(ops.selected_attention, (q, k_sel, v_sel, selection, lp, scale, cu_seqlens))
    o, lse2 = (x.detach() for x in ops.selected_attention(q, k_sel, v_sel, selection, lp, scale, cu_seqlens))
    do = _layout(torch.randn(*o.shape, generator=gen).to(q.device), layout, gen).detach()
    args = (do, q.detach(), k_sel.detach(), v_sel.detach(), o, lse2, selection, lp, scale, cu_seqlens)
    torch.library.opcheck(ops.selected_attention_backward, args)
