"""Packed documents on the Triton backend (under the interpreter here): with cu_seqlens, outputs,
selections and all eight input gradients equal those of each document run alone, and equal the
reference's packed results; the packed op passes opcheck and compiles once for moving boundaries."""

from __future__ import annotations

import pytest
import torch

from components.nsa import nsa_attention, select_blocks
from components.nsa.triton import packed_attention
from components.nsa.triton.launch import interpreting
from components.nsa.triton.per_document import packed_attention_backward
from tests.test_nsa_bruteforce import HYPER_NAMES, make_inputs

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                 reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")]

HP = dict(zip(HYPER_NAMES, (8, 4, 16, 3, 20), strict=True))  # l, d, l', n, w
ORDER = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")
# One token, shorter than l, than l', than w, over several selection blocks; and two of equal length.
LENGTHS = (1, 5, 12, 19, 52, 3, 12)
H, HKV, D = 4, 2, 16


def _packed(docs):
    packed = {name: torch.cat([d[name].detach() for d in docs], dim=1).requires_grad_() for name in ORDER}
    cu_seqlens = torch.tensor([0, *torch.tensor([d["q"].shape[1] for d in docs]).cumsum(0).tolist()])
    return packed, cu_seqlens


@pytest.fixture(scope="module")
def documents():
    return [make_inputs(1, n, H, HKV, D, HP, dtype=torch.float32, seed=i, requires_grad=True)
            for i, n in enumerate(LENGTHS)]


def test_packed_equals_separate_and_the_reference(documents):
    packed, cu_seqlens = _packed(documents)
    together = nsa_attention(**packed, **HP, backend="triton", cu_seqlens=cu_seqlens)
    alone = [nsa_attention(**d, **HP, backend="triton") for d in documents]
    torch.testing.assert_close(together, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-6)
    reference = nsa_attention(**packed, **HP, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(together, reference, rtol=2e-4, atol=2e-5)

    sel_hp = {k: v for k, v in HP.items() if k != "window_size"}
    assert torch.equal(select_blocks(packed["q"], packed["k_cmp"], **sel_hp, cu_seqlens=cu_seqlens),
                       torch.cat([select_blocks(d["q"], d["k_cmp"], **sel_hp) for d in documents], dim=1))

    grad_o = torch.randn(together.shape, generator=torch.Generator().manual_seed(3))
    packed_grads = torch.autograd.grad(together, [packed[n] for n in ORDER], grad_o)
    pieces = grad_o.split(list(LENGTHS), dim=1)
    alone_grads = [torch.autograd.grad(o, [d[n] for n in ORDER], g) for d, o, g in zip(documents, alone, pieces)]
    reference_grads = torch.autograd.grad(reference, [packed[n] for n in ORDER], grad_o)
    for i, name in enumerate(ORDER):
        torch.testing.assert_close(packed_grads[i], torch.cat([g[i] for g in alone_grads], dim=1), rtol=1e-5,
                                   atol=1e-6, msg=name)
        torch.testing.assert_close(packed_grads[i], reference_grads[i], rtol=2e-4, atol=2e-5, msg=name)


def test_opcheck(documents):
    packed, cu_seqlens = _packed([documents[1], documents[3]])  # 5 and 19 tokens: short, and with blocks
    args = (*(packed[n].detach().requires_grad_() for n in ORDER), *HP.values(), cu_seqlens)
    torch.library.opcheck(packed_attention, args)
    grad_o = torch.randn(packed["q"].shape)
    torch.library.opcheck(packed_attention_backward, (grad_o, *(packed[n].detach() for n in ORDER),
                                                      *HP.values(), cu_seqlens))


def test_compiled_packed_op_does_not_recompile_when_boundaries_move():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda x, cu: nsa_attention(**x, **HP, backend="triton", cu_seqlens=cu),
                             fullgraph=True, backend=counter)
    torch._dynamo.reset()
    for lengths in ((9, 23), (17, 15), (30, 2)):  # 32 tokens, 2 documents, other compressed-block counts
        docs = [make_inputs(1, n, H, HKV, D, HP, dtype=torch.float32, seed=n) for n in lengths]
        x, cu = _packed(docs)
        x = {k: v.detach() for k, v in x.items()}
        torch._dynamo.maybe_mark_dynamic(x["k_cmp"], 1)
        torch._dynamo.maybe_mark_dynamic(x["v_cmp"], 1)
        torch.testing.assert_close(compiled(x, cu), nsa_attention(**x, **HP, backend="triton", cu_seqlens=cu),
                                   rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
