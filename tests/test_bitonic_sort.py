"""The selection kernel's sorting pieces on their own: a descending sort and the running top-N merge
(under Triton's interpreter without a GPU, as tests/conftest.py sets it)."""

import pytest
import torch
import triton
import triton.language as tl

from components.nsa.triton.bitonic_sort import merge_top_descending, sort_descending
from components.nsa.triton.launch import interpreting

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _sort_and_merge_kernel(TOP, NEW, SORTED, MERGED, ROWS: tl.constexpr, LOG_N: tl.constexpr):
    N: tl.constexpr = 1 << LOG_N
    offs = tl.arange(0, ROWS)[:, None] * N + tl.arange(0, N)[None, :]
    new = tl.load(NEW + offs)
    tl.store(SORTED + offs, sort_descending(new, ROWS, LOG_N))
    tl.store(MERGED + offs, merge_top_descending(tl.load(TOP + offs), new, ROWS, LOG_N))


@pytest.mark.parametrize("log_n", [1, 4, 5])
def test_sort_and_top_merge_match_torch(log_n):
    rows, n = 8, 1 << log_n
    g = torch.Generator().manual_seed(log_n)
    # Distinct keys (as the selection's score | index keys are), some rows padded with -1 (invalid).
    keys = torch.randperm(4 * rows * n, generator=g).view(2, rows, 2 * n)[..., :n].clone() * 2**32
    keys[:, ::3, n // 2:] = -1
    top = keys[0].sort(dim=1, descending=True).values.to(DEVICE)
    new = keys[1].to(DEVICE)
    sorted_out, merged = torch.empty_like(new), torch.empty_like(new)
    _sort_and_merge_kernel[(1,)](top, new, sorted_out, merged, ROWS=rows, LOG_N=log_n)
    assert torch.equal(sorted_out, new.sort(dim=1, descending=True).values)
    both = torch.cat([top, new], dim=1).sort(dim=1, descending=True).values[:, :n]
    assert torch.equal(merged, both)
