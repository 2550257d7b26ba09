"""The reference backend as an opaque custom op: same numbers as the eager reference, compiles once."""

from __future__ import annotations

import pytest
import torch

from components.nsa import nsa_attention
from components.nsa.reference import nsa_attention_at_reference
from components.nsa.reference_op import reference_attention
from tests.test_nsa_bruteforce import HYPER_NAMES, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

HP = dict(zip(HYPER_NAMES, (8, 4, 16, 3, 20), strict=True))
ORDER = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")


def test_op_and_its_backward_equal_the_eager_reference():
    """Same forward bits; gradients equal to autograd through the eager reference (fp32, 37 tokens, G=2)."""
    inputs = make_inputs(2, 37, 4, 2, 8, HP, dtype=torch.float32, seed=3, requires_grad=True)
    grad_o = torch.randn(2, 37, 4, 8, generator=torch.Generator().manual_seed(1))
    eager = nsa_attention_at_reference(**inputs, q_start=0, **HP)
    eager_grads = torch.autograd.grad(eager, [inputs[n] for n in ORDER], grad_o)
    op = nsa_attention(**inputs, **HP)
    op_grads = torch.autograd.grad(op, [inputs[n] for n in ORDER], grad_o)
    assert torch.equal(op, eager)
    for name, a, b in zip(ORDER, op_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_opcheck():
    inputs = make_inputs(1, 21, 2, 1, 4, HP, dtype=torch.float32, seed=5, requires_grad=True)
    args = tuple(inputs[n] for n in ORDER) + tuple(HP[n] for n in HYPER_NAMES)
    torch.library.opcheck(reference_attention, args)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiles_once_for_every_length(backend):
    """One dynamic graph serves every sequence length: no chunk loop is unrolled into it."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: nsa_attention(**x, **HP), fullgraph=True, backend=backend, dynamic=True)
    from torch._dynamo.utils import counters

    counters.clear()
    for T in (40, 57, 77):
        inputs = make_inputs(1, T, 4, 2, 8, HP, dtype=torch.float32, seed=T)
        torch.testing.assert_close(compiled(inputs), nsa_attention(**inputs, **HP), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1


def test_documents_of_equal_length_run_together_yet_each_on_its_own():
    """The reference op batches packed documents of one length into one call; each still gets its
    own outputs and gradients (fp64)."""
    lengths = (7, 19, 7, 7, 19)
    docs = [make_inputs(1, n, 4, 2, 8, HP, dtype=torch.float64, seed=i, requires_grad=True)
            for i, n in enumerate(lengths)]
    packed = {name: torch.cat([d[name].detach() for d in docs], dim=1).requires_grad_() for name in ORDER}
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    together = nsa_attention(**packed, **HP, cu_seqlens=cu_seqlens)
    alone = [nsa_attention(**d, **HP) for d in docs]
    torch.testing.assert_close(together, torch.cat(alone, dim=1), rtol=1e-12, atol=1e-12)
    grad_o = torch.randn(together.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad(together, [packed[n] for n in ORDER], grad_o)
    pieces = grad_o.split(list(lengths), dim=1)
    alone_grads = [torch.autograd.grad(o, [d[n] for n in ORDER], g) for d, o, g in zip(docs, alone, pieces)]
    for i, name in enumerate(ORDER):
        torch.testing.assert_close(grads[i], torch.cat([g[i] for g in alone_grads], dim=1), rtol=1e-12, atol=1e-12,
                                   msg=name)


def test_an_autocast_region_changes_nothing():
    """The spec computes in the inputs' dtype with fp32 scores: bf16 autocast around the op (as the trainer
    runs the forward; the backward runs outside it) gives the same bits, selections and gradients.
    Autocast used to run the reference's matmuls in bf16 and pick other blocks than its backward did."""
    from components.nsa import select_blocks

    hp = dict(zip(HYPER_NAMES, (8, 4, 8, 5, 20), strict=True))
    inputs = make_inputs(1, 400, 8, 1, 32, hp, dtype=torch.float32, seed=1, requires_grad=True)
    grad_o = torch.randn(1, 400, 8, 32, generator=torch.Generator().manual_seed(2))
    plain = nsa_attention(**inputs, **hp)
    plain_grads = torch.autograd.grad(plain, [inputs[n] for n in ORDER], grad_o)
    select_hp = {k: hp[k] for k in ("block_size", "block_stride", "sel_block_size", "num_selected")}
    chosen = select_blocks(inputs["q"], inputs["k_cmp"], **select_hp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = nsa_attention(**inputs, **hp)
        assert torch.equal(select_blocks(inputs["q"], inputs["k_cmp"], **select_hp), chosen)
        decode = nsa_attention_at_reference(**inputs, q_start=0, **hp)
    under_grads = torch.autograd.grad(under, [inputs[n] for n in ORDER], grad_o)
    assert under.dtype == torch.float32 and torch.equal(under, plain) and torch.equal(decode, plain)
    for name, a, b in zip(ORDER, under_grads, plain_grads, strict=True):
        assert torch.equal(a, b), name
