"""The selected branch's masked layout (causal flash attention hiding unselected key blocks,
selection_mask.py) against its query-major kernels, which tests/test_nsa_triton.py holds to the
reference: same o, lse2, dq, dk, dv on random valid selections (unused slots, blocks cut by a
document's end, packed documents, query offsets, key tiles smaller than a selection block, head
groups of 1 to 17). Under the interpreter in fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from components.nsa.triton.launch import interpreting
from components.nsa.triton.selected_attention_bwd import selected_attention_bwd
from components.nsa.triton.selected_attention_fwd import selected_attention_fwd
from components.nsa.triton.selected_attention_masked import selected_attention_bwd_masked, selected_attention_fwd_masked
from components.nsa.triton.selection_mask import Chosen
from tests.test_nsa_triton_block_major import layout_case

pytestmark = [
    pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                       reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"),
    pytest.mark.usefixtures("one_thread"),
]

# (key lengths per document, queries per document or None for all, H, Hkv, D, l', n, dtype)
CASES = [
    pytest.param([45], None, 6, 2, 16, 16, 2, torch.float32, id="G3-Hkv2"),
    pytest.param([70], None, 1, 1, 16, 32, 1, torch.float32, id="G1-one-slot"),
    pytest.param([50], None, 17, 1, 24, 16, 2, torch.float32, id="G17-D24"),
    pytest.param([100], None, 3, 1, 16, 48, 2, torch.float32, id="lsel48-key-tiles-of-16"),
    pytest.param([17, 1, 40], None, 6, 2, 16, 16, 2, torch.float32, id="packed"),
    pytest.param([17, 1, 40, 9], [5, 1, 9, 9], 6, 2, 16, 16, 2, torch.float32, id="query-offsets"),
    pytest.param([63], None, 6, 2, 32, 16, 3, torch.float16, id="G3-fp16"),
]


@pytest.mark.parametrize("lengths,counts,H,Hkv,D,lp,n,dtype", CASES)
def test_masked_layout_equals_query_major(lengths, counts, H, Hkv, D, lp, n, dtype):
    q, k, v, do, sel, docs, scale, tol = layout_case(lengths, counts, H, Hkv, D, lp, n, dtype,
                                                     seed=len(lengths) * 100 + H + lp)

    o_ref, lse_ref = selected_attention_fwd(q, k, v, sel, lp, scale, *docs)
    o, lse = selected_attention_fwd_masked(q, k, v, sel, lp, scale, *docs)
    torch.testing.assert_close(lse, lse_ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(o, o_ref, **tol)

    grads_ref = selected_attention_bwd(do, q, k, v, o_ref, lse_ref, sel, lp, scale, *docs, dq_layout="query")
    grads = selected_attention_bwd_masked(do, q, k, v, o_ref, lse_ref, sel, lp, scale, *docs)
    for name, mine, ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(mine, ref, **tol, msg=name)


def test_the_mask_holds_each_querys_selected_blocks_and_nothing_else():
    """chosen[b, g, j, t] is 1 exactly where query t of row b chose block j for group g; -1 slots mark nothing."""
    sel = torch.tensor([[[[0, -1]], [[0, 1]], [[1, -1]]], [[[0, -1]], [[-1, -1]], [[0, 1]]]])  # [B=2, T=3, Hkv=1, 2]
    chosen = Chosen.of(sel, 2, 3)
    expected = torch.tensor([[[[1, 1, 0], [0, 1, 1]]], [[[1, 0, 1], [0, 0, 1]]]], dtype=torch.uint8)
    assert chosen.mask.shape == (2, 1, 2, 3) and torch.equal(chosen.mask, expected)
    # Queries that are their rows' last ones (context parallelism) choose among the blocks of more keys.
    assert Chosen.of(torch.tensor([[[[2]]]]), 2, 6).mask.view(-1).tolist() == [0, 0, 1]


@pytest.mark.parametrize("block_n, lp, tile", [(64, 64, 64), (128, 64, 64), (64, 48, 16), (32, 96, 32), (64, 16, 16)])
def test_a_key_tile_lies_inside_one_selection_block(block_n, lp, tile):
    assert Chosen(torch.empty(0), lp).key_tile(block_n) == tile
