"""Query offsets (cu_seqlens_q), the op's form for context parallelism: each packed document keeps all
its keys but only its last queries. Outputs, and all eight input gradients for an upstream gradient
on those queries, equal the full packed op's at the same positions; fp64, so the comparison is tight."""

from __future__ import annotations

import pytest
import torch

from components.errors import UserError
from components.nsa import nsa_attention, register_backend, unregister_backend
from tests.test_nsa_packed import HP, LENGTHS, ORDER, _documents, _packed

pytestmark = pytest.mark.usefixtures("one_thread")

QUERY_INPUTS = ("q", "gates")


def _keep_last(lengths, counts):
    """Row indices of each document's last `count` queries in the packed row, and cu_seqlens_q."""
    keep, start = [], 0
    for n, c in zip(lengths, counts):
        keep += range(start + n - c, start + n)
        start += n
    return torch.tensor(keep), torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])


@pytest.mark.parametrize("counts", [(1, 2, 12, 7, 33, 3), (1, 5, 12, 19, 70, 3), (1, 1, 1, 1, 1, 1)],
                         ids=["some", "all", "last-only"])
def test_last_queries_of_each_document_equal_the_full_packed_op(counts):
    packed, cu_seqlens = _packed(_documents(LENGTHS))
    keep, cu_seqlens_q = _keep_last(LENGTHS, counts)
    grad_o = torch.randn(1, len(keep), 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    full = nsa_attention(**packed, **HP, cu_seqlens=cu_seqlens)
    full_grad = torch.zeros_like(full).index_copy(1, keep, grad_o)
    expected = [full[:, keep].detach(), *torch.autograd.grad(full, [packed[k] for k in ORDER], full_grad)]
    expected = [g[:, keep] if name in QUERY_INPUTS else g for name, g in zip(("o", *ORDER), expected)]

    leaves = {k: (v.detach()[:, keep] if k in QUERY_INPUTS else v.detach()).requires_grad_() for k, v in packed.items()}
    out = nsa_attention(**leaves, **HP, cu_seqlens=cu_seqlens, cu_seqlens_q=cu_seqlens_q)
    got = [out.detach(), *torch.autograd.grad(out, [leaves[k] for k in ORDER], grad_o)]
    for name, mine, theirs in zip(("o", *ORDER), got, expected):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12, msg=name)


def test_bad_query_counts_are_refused():
    packed, cu_seqlens = _packed(_documents((5, 9)))
    q = {k: v.detach() for k, v in packed.items()}
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        nsa_attention(**q, **HP, cu_seqlens_q=torch.tensor([0, 14]))
    with pytest.raises(ValueError, match="same documents"):
        nsa_attention(**q, **HP, cu_seqlens=cu_seqlens, cu_seqlens_q=torch.tensor([0, 14]))
    with pytest.raises(ValueError, match="at most one per key"):
        nsa_attention(**q, **HP, cu_seqlens=cu_seqlens, cu_seqlens_q=torch.tensor([0, 6, 14]))


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
