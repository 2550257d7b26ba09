"""Query offsets (cu_seqlens_q), the op's form for context parallelism: each packed document keeps all
its keys but only its last queries. Outputs, selections, and all eight input gradients for an
upstream gradient on those queries, equal the full packed op's at the same positions: the reference
in fp64 (tight), the Triton kernels in fp32 under the interpreter (fp32 tolerance)."""

from __future__ import annotations

import pytest
import torch

from components.errors import UserError
from components.nsa import nsa_attention, register_backend, unregister_backend
from components.nsa.documents import BLOCK, QUERY, TOKEN, per_document
from components.nsa.reference_op import reference_attention
from components.nsa.selection import select_blocks_at_reference
from tests.test_nsa_bruteforce import HYPER_NAMES
from tests.test_nsa_packed import DEVICE, HP, LENGTHS, ORDER, _documents, _packed, triton_only

pytestmark = pytest.mark.usefixtures("one_thread")

QUERY_INPUTS = ("q", "gates")


def _keep_last(lengths, counts):
    """Row indices of each document's last `count` queries in the packed row, and cu_seqlens_q."""
    keep, start = [], 0
    for n, c in zip(lengths, counts):
        keep += range(start + n - c, start + n)
        start += n
    return torch.tensor(keep), torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])


COUNTS = {"some": (1, 2, 12, 7, 33, 3), "all": LENGTHS, "last-only": (1,) * len(LENGTHS)}
BACKENDS = [("reference", torch.float64, 1e-12), pytest.param("triton", torch.float32, 5e-5, marks=triton_only)]


def _full_and_offset(backend, dtype, counts):
    """(the full packed op's o and gradients at the kept queries, the offset form's), in ("o", *ORDER) order."""
    device = DEVICE if backend == "triton" else "cpu"
    packed, cu_seqlens = _packed(_documents(LENGTHS, dtype=dtype, device=device))
    keep, cu_seqlens_q = (x.to(device) for x in _keep_last(LENGTHS, counts))
    grad_o = torch.randn(1, len(keep), 4, 8, dtype=dtype, generator=torch.Generator().manual_seed(3)).to(device)

    full = nsa_attention(**packed, **HP, backend=backend, cu_seqlens=cu_seqlens)
    full_grad = torch.zeros_like(full).index_copy(1, keep, grad_o)
    expected = [full[:, keep].detach(), *torch.autograd.grad(full, [packed[k] for k in ORDER], full_grad)]
    expected = [g[:, keep] if name in QUERY_INPUTS else g for name, g in zip(("o", *ORDER), expected)]

    leaves = {k: (v.detach()[:, keep] if k in QUERY_INPUTS else v.detach()).requires_grad_() for k, v in packed.items()}
    out = nsa_attention(**leaves, **HP, backend=backend, cu_seqlens=cu_seqlens, cu_seqlens_q=cu_seqlens_q)
    got = [out.detach(), *torch.autograd.grad(out, [leaves[k] for k in ORDER], grad_o)]
    return expected, got, (leaves, grad_o, cu_seqlens, cu_seqlens_q)


@pytest.mark.parametrize("counts", sorted(COUNTS))
@pytest.mark.parametrize("backend,dtype,tol", BACKENDS)
def test_last_queries_of_each_document_equal_the_full_packed_op(backend, dtype, tol, counts):
    expected, got, _ = _full_and_offset(backend, dtype, COUNTS[counts])
    for name, mine, theirs in zip(("o", *ORDER), got, expected):
        torch.testing.assert_close(mine, theirs, rtol=tol, atol=tol, msg=name)


@triton_only
def test_triton_offsets_select_the_reference_blocks_and_match_it(selected_layouts):
    """The Triton kernels' selection with query offsets is the reference's, and so are o and gradients."""
    from components.nsa.triton import ops

    _, got, (leaves, grad_o, cu_seqlens, cu_seqlens_q) = _full_and_offset("triton", torch.float32, COUNTS["some"])
    cu_seqlens, cu_seqlens_q = cu_seqlens.cpu(), cu_seqlens_q.cpu()
    as_reference = {k: v.detach().cpu().double().requires_grad_() for k, v in leaves.items()}
    reference = nsa_attention(**as_reference, **HP, cu_seqlens=cu_seqlens, cu_seqlens_q=cu_seqlens_q)
    grads = torch.autograd.grad(reference, [as_reference[k] for k in ORDER], grad_o.cpu().double())
    torch.testing.assert_close(got[0].cpu().double(), reference.detach(), rtol=5e-5, atol=5e-5)
    for name, mine, ref in zip(ORDER, got[1:], grads):
        torch.testing.assert_close(mine.cpu().double(), ref, rtol=5e-5, atol=5e-5, msg=name)
    q, k_cmp = leaves["q"].detach(), leaves["k_cmp"].detach()
    scale = q.shape[-1] ** -0.5
    docs = [x.to(q.device) for x in (cu_seqlens, cu_seqlens_q)]
    _, lse2 = ops.interval_attention(q, k_cmp, k_cmp, HP["block_stride"], HP["block_size"] - 1, 0, scale, *docs)
    mine = ops.select_blocks(q, k_cmp, lse2, HP["block_size"], HP["block_stride"], HP["sel_block_size"],
                             HP["num_selected"], scale, *docs)
    # The reference's selection for each document's last queries (k_sel only says where the tokens are).
    hyper = {k: v for k, v in HP.items() if k != "window_size"}
    theirs = per_document(lambda q_doc, k_doc, _tokens, q_start: select_blocks_at_reference(q_doc, k_doc,
                                                                                            q_start=q_start, **hyper),
                          tuple(as_reference[k].detach() for k in ("q", "k_cmp", "k_sel")), (QUERY, BLOCK, TOKEN),
                          cu_seqlens, HP["block_size"], HP["block_stride"], cu_seqlens_q)
    assert torch.equal(mine.cpu(), theirs)


def test_opcheck_with_query_offsets():
    packed, cu_seqlens = _packed(_documents([9, 1, 22], dtype=torch.float32))
    keep, cu_seqlens_q = _keep_last([9, 1, 22], [4, 1, 10])
    args = tuple(packed[n].detach()[:, keep].requires_grad_() if n in QUERY_INPUTS else packed[n] for n in ORDER)
    torch.library.opcheck(reference_attention, args + tuple(HP[n] for n in HYPER_NAMES) + (cu_seqlens, cu_seqlens_q))


def test_bad_query_counts_are_refused():
    packed, cu_seqlens = _packed(_documents((5, 9)))
    q = {k: v.detach() for k, v in packed.items()}
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        nsa_attention(**q, **HP, cu_seqlens_q=torch.tensor([0, 14]))
    with pytest.raises(ValueError, match="same documents"):
        nsa_attention(**q, **HP, cu_seqlens=cu_seqlens, cu_seqlens_q=torch.tensor([0, 14]))
    with pytest.raises(ValueError, match="at most one per key"):
        nsa_attention(**q, **HP, cu_seqlens=cu_seqlens, cu_seqlens_q=torch.tensor([0, 6, 14]))
    # 11 queries (the first document's last 5, the second's last 6): counts that do not add up to them
    # would take the wrong rows (12) or leave one out (10), for every backend.
    keep, _ = _keep_last((5, 9), (5, 6))
    last = {k: v[:, keep] if k in QUERY_INPUTS else v for k, v in q.items()}
    for backend in ("reference", "triton"):
        for wrong in ([0, 5, 12], [0, 5, 10]):
            with pytest.raises(ValueError, match=f"cu_seqlens_q must end at Tq = 11 .q's queries., got {wrong[-1]}"):
                nsa_attention(**last, **HP, backend=backend, cu_seqlens=cu_seqlens, cu_seqlens_q=torch.tensor(wrong))


def test_a_backend_without_query_offsets_gets_one_clear_error():
    def plugin(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, cu_seqlens=None, **hyper):
        raise AssertionError("never called")

    register_backend("no_offsets", plugin)
    try:
        packed, cu_seqlens = _packed(_documents((5, 9)))
        q = {k: v.detach() for k, v in packed.items()}
        with pytest.raises(UserError, match="does not take query offsets.*context_parallel_degree = 1"):
            nsa_attention(**q, **HP, backend="no_offsets", cu_seqlens=cu_seqlens,
                          cu_seqlens_q=torch.tensor([0, 5, 14]))
    finally:
        unregister_backend("no_offsets")
