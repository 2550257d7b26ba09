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
from tests.test_nsa_triton_block_major import DEVICE, layout_case, spy_on_layouts

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


def test_masked_layout_equals_query_major_on_several_rows():
    """Rows of a batch with selections of their own: each program reads its own row's."""
    rows = [layout_case([45], None, 6, 2, 16, 16, 3, torch.float32, seed=seed) for seed in (1, 2)]
    q, k, v, do, sel = (torch.cat([row[i] for row in rows]) for i in range(5))
    assert not torch.equal(sel[0], sel[1])
    scale, tol = rows[0][6], rows[0][7]
    o_ref, lse_ref = selected_attention_fwd(q, k, v, sel, 16, scale)
    o, lse = selected_attention_fwd_masked(q, k, v, sel, 16, scale)
    torch.testing.assert_close(lse, lse_ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(o, o_ref, **tol)
    grads_ref = selected_attention_bwd(do, q, k, v, o_ref, lse_ref, sel, 16, scale, dq_layout="query")
    grads = selected_attention_bwd_masked(do, q, k, v, o_ref, lse_ref, sel, 16, scale)
    for name, mine, ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(mine, ref, **tol, msg=name)


@pytest.mark.parametrize("per_head, split_queries", [(False, None), (True, None), (False, 7), (True, 7)],
                         ids=["group-programs", "head-programs", "group-programs-split", "head-programs-split"])
@pytest.mark.parametrize("packed", [False, True], ids=["one-row", "packed"])
def test_the_masked_dkdv_equals_query_major_in_every_work_split(per_head, split_queries, packed):
    """The dK/dV kernel's programs per KV group (summing the group's heads themselves) or per query head (summed
    afterwards), each over all the queries that see its key tile or over runs of them: the default picks one by
    the amount of parallelism, so short test rows would reach only some."""
    from components.nsa.triton.interval_attention import interval_attention_bwd
    from components.nsa.triton.selected_attention_masked import CAUSAL

    lengths = [30, 1, 40] if packed else [70]
    q, k, v, do, sel, docs, scale, tol = layout_case(lengths, None, 6, 2, 16, 16, 3, torch.float32, seed=11)
    o, lse = selected_attention_fwd(q, k, v, sel, 16, scale, *docs)
    _, dk_ref, dv_ref = selected_attention_bwd(do, q, k, v, o, lse, sel, 16, scale, *docs, dq_layout="query")
    _, dk, dv = interval_attention_bwd(do, q, k, v, o, lse, sm_scale=scale, cu_seqlens=docs[0] if docs else None,
                                       chosen=Chosen.of(sel, 16, k.shape[1]), per_head=per_head,
                                       split_queries=split_queries, **CAUSAL)
    torch.testing.assert_close(dk, dk_ref, **tol)
    torch.testing.assert_close(dv, dv_ref, **tol)


def test_selections_of_rows_past_int16_blocks_are_int32():
    """Block numbers past int16 (rows of more than 32,767 selection blocks) are kept as int32, and the kernels
    read them as such: the masked layout on a selection stored wide equals the narrow one."""
    sel = torch.tensor([[[[0, 5, -1]]]])
    assert Chosen.of(sel, 16, 16 * 32767).selection.dtype == torch.int16
    assert Chosen.of(sel, 16, 16 * 32767 + 1).selection.dtype == torch.int32
    q, k, v, do, sel, _, scale, tol = layout_case([45], None, 6, 2, 16, 16, 3, torch.float32, seed=3)
    from components.nsa.triton.interval_attention import interval_attention_fwd
    from components.nsa.triton.selected_attention_masked import CAUSAL

    narrow = interval_attention_fwd(q, k, v, sm_scale=scale, chosen=Chosen.of(sel, 16, 45), **CAUSAL)
    wide = interval_attention_fwd(q, k, v, sm_scale=scale, chosen=Chosen(sel.to(torch.int32), 16), **CAUSAL)
    for a, b in zip(narrow, wide):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lp, fits", [(8, False), (24, False), (40, False), (16, True), (48, True), (64, True)])
def test_the_masked_layout_needs_key_tiles_of_16_inside_a_block(lp, fits):
    """tl.dot's tiles are 16 keys or more: a selection block of 8 (or not a multiple of 16) keeps the gather
    layouts however short the row. (The interpreter would run 8-key tiles; a GPU build would not.)"""
    from components.nsa.triton import tile_configs

    assert tile_configs.masked_layout_fits(lp) is fits
    layout = tile_configs.selected_layout_for(64, 6, 2, 2, 16, lp, 4, row_keys=lp)
    assert (layout == "masked") is fits


@pytest.mark.parametrize("block_n, lp, tile", [(64, 64, 64), (128, 64, 64), (64, 48, 16), (32, 96, 32), (64, 16, 16)])
def test_a_key_tile_lies_inside_one_selection_block(block_n, lp, tile):
    assert Chosen(torch.empty(0), lp).key_tile(block_n) == tile


@pytest.mark.parametrize("max_seqlen, layouts", [(None, ["forward"]), (48, ["masked", "masked"])])
def test_a_packed_row_of_short_documents_takes_the_masked_layout_given_max_seqlen(monkeypatch, max_seqlen, layouts):
    """A packed row longer than MASKED_LAYOUT_MAX_ROW x n x l' keys whose documents are short: max_seqlen (a bound
    on their lengths, a hint) moves it to the masked layout, forward and backward; without it the row's length
    counts. The same result either way: the reference's."""
    from components.nsa import nsa_attention
    from components.nsa.triton import tile_configs
    from tests.test_nsa_packed import HP, ORDER, _documents, _grad_out, _output_and_grads, _packed

    monkeypatch.setattr(tile_configs, "MASKED_LAYOUT_MAX_ROW", 1)  # rows of at most n x l' = 48 keys
    assert HP["num_selected"] * HP["sel_block_size"] == 48
    calls = spy_on_layouts(monkeypatch)
    docs = _documents([30, 40, 20], dtype=torch.float32, device=DEVICE)
    packed, cu_seqlens = _packed(docs)
    grad_o = _grad_out(docs)
    out = nsa_attention(**packed, **HP, backend="triton", cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    mine = [out.detach(), *torch.autograd.grad(out, [packed[k] for k in ORDER], grad_o)]
    reference = _output_and_grads(packed, grad_o, "reference", cu_seqlens)
    for name, a, b in zip(("o",) + ORDER, mine, reference):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=5e-5, msg=name)
    assert calls == layouts  # the block layout's forward (and dQ), or the masked layout both ways


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_max_seqlen_must_be_a_positive_int(bad):
    from components.errors import UserError
    from components.nsa import nsa_attention
    from tests.test_nsa_packed import HP, _documents, _packed

    packed, cu_seqlens = _packed(_documents([5, 7]))
    with pytest.raises(UserError, match="max_seqlen must be a positive int"):
        nsa_attention(**packed, **HP, backend="reference", cu_seqlens=cu_seqlens, max_seqlen=bad)


def test_a_backend_that_does_not_name_max_seqlen_is_not_passed_it():
    from components.nsa import nsa_attention
    from components.nsa.backends import register_backend, unregister_backend
    from components.nsa.reference_op import reference_attention
    from tests.test_nsa_packed import HP, _documents, _packed

    def plain(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size, block_stride, sel_block_size,
              num_selected, window_size, cu_seqlens=None):
        return reference_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_size, block_stride,
                                   sel_block_size, num_selected, window_size, cu_seqlens, None)

    register_backend("plain_for_test", plain)
    try:
        packed, cu_seqlens = _packed(_documents([5, 7]))
        out = nsa_attention(**packed, **HP, backend="plain_for_test", cu_seqlens=cu_seqlens, max_seqlen=7)
        torch.testing.assert_close(out, nsa_attention(**packed, **HP, backend="reference", cu_seqlens=cu_seqlens))
    finally:
        unregister_backend("plain_for_test")


@pytest.mark.parametrize("max_seqlen", [None, 20, 200], ids=["none-gather", "masked", "past-the-row-gather"])
def test_the_selected_ops_pass_opcheck_with_max_seqlen(monkeypatch, max_seqlen):
    """nsa_triton::selected_attention and its backward with the max_seqlen hint (a SymInt under torch.compile):
    schema, fake kernels, autograd registration, in each layout it picks for a packed row of 58 keys."""
    from components.nsa.triton import ops, tile_configs

    monkeypatch.setattr(tile_configs, "MASKED_LAYOUT_MAX_ROW", 1)  # rows of at most n x l' = 48 keys
    calls = spy_on_layouts(monkeypatch)
    q, k, v, do, sel, (cu_seqlens, _), scale, _ = layout_case([18, 20, 20], None, 4, 2, 16, 16, 3, torch.float32,
                                                             seed=5)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(ops.selected_attention, (*leaves, sel, 16, scale, cu_seqlens, None, max_seqlen))
    o, lse2 = (x.detach() for x in ops.selected_attention(*leaves, sel, 16, scale, cu_seqlens, None, max_seqlen))
    detached = (x.detach() for x in (q, k, v))
    torch.library.opcheck(ops.selected_attention_backward,
                          (do, *detached, o, lse2, sel, 16, scale, cu_seqlens, None, max_seqlen))
    assert set(calls) == ({"masked"} if max_seqlen == 20 else {"forward"})  # G = 2: the block layout's gather


def test_a_max_seqlen_read_from_a_shape_compiles_and_picks_the_layout(monkeypatch):
    """Under torch.compile (fullgraph, the default inductor backend, dynamic shapes) max_seqlen taken from a
    size is a SymInt: the op still picks the masked layout from it, both ways, at two lengths, with the eager
    op's numbers."""
    from components.nsa import nsa_attention
    from tests.test_nsa_packed import HP, ORDER, _documents, _grad_out, _output_and_grads, _packed

    def attention(cu_seqlens, *xs):
        return nsa_attention(*xs, **HP, backend="triton", cu_seqlens=cu_seqlens, max_seqlen=xs[0].shape[1])

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(attention, fullgraph=True, dynamic=True)
    calls = spy_on_layouts(monkeypatch)
    for lengths in ([20, 17], [25, 20]):
        docs = _documents(lengths, dtype=torch.float32, device=DEVICE)
        packed, cu_seqlens = _packed(docs)
        grad_o = _grad_out(docs)
        inputs = [packed[name] for name in ORDER]
        out = compiled(cu_seqlens, *inputs)
        mine = [out.detach(), *torch.autograd.grad(out, inputs, grad_o)]
        assert calls == ["masked", "masked"], lengths
        calls.clear()
        eager = _output_and_grads(packed, grad_o, "triton", cu_seqlens)
        for name, a, b in zip(("o",) + ORDER, mine, eager):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
        calls.clear()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for both lengths
