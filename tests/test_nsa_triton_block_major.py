"""The selected branch's block-major forward and dQ against its query-major kernels, which
tests/test_nsa_triton.py holds to the reference: same o, lse2, dq, dk, dv on random valid
selections (unused slots, blocks cut by a document's end, query offsets, key blocks in several
sub-tiles, head groups of 1 to 17), whatever the work split. Under the interpreter in fp32 and fp16."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from components.nsa.triton.launch import interpreting
from components.nsa.triton.selected_attention_bwd import selected_attention_bwd
from components.nsa.triton.selected_attention_fwd import selected_attention_fwd
from components.nsa.triton.selected_attention_fwd_blocks import selected_attention_fwd_blocks

pytestmark = [
    pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                       reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"),
    pytest.mark.usefixtures("one_thread"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_selection(key_lengths, query_counts, Hkv, sel_block_size, n, generator):
    """sel_idx [1, Tq, Hkv, n]: for each query (a document's last query_counts[i] of key_lengths[i]
    tokens) up to n distinct blocks at or before its own, ascending, -1 after the used slots."""
    rows = []
    for keys, count in zip(key_lengths, query_counts):
        for pos in range(keys - count, keys):
            visible = pos // sel_block_size + 1
            for _ in range(Hkv):
                used = min(n, int(torch.randint(1, visible + 1, (1,), generator=generator)))
                chosen = torch.randperm(visible, generator=generator)[:used].sort().values.tolist()
                rows.append(chosen + [-1] * (n - used))
    return torch.tensor(rows, device=DEVICE).view(1, sum(query_counts), Hkv, n)


# (key lengths per document, queries per document or None for all, H, Hkv, D, l', n, dtype)
CASES = [
    pytest.param([45], None, 6, 2, 16, 8, 3, torch.float32, id="G3-Hkv2"),
    pytest.param([37], None, 1, 1, 16, 16, 3, torch.float32, id="G1"),
    pytest.param([40], None, 17, 1, 24, 24, 2, torch.float32, id="G17-D24-lsel24"),
    pytest.param([100], None, 3, 1, 16, 96, 2, torch.float32, id="lsel96-sub-tiles"),
    pytest.param([17, 1, 22], None, 6, 2, 16, 8, 3, torch.float32, id="packed"),
    pytest.param([17, 1, 22, 9], [5, 1, 9, 9], 6, 2, 16, 8, 3, torch.float32, id="query-offsets"),
    pytest.param([63], None, 6, 2, 32, 16, 4, torch.float16, id="G3-fp16"),
]


def layout_case(lengths, counts, H, Hkv, D, lp, n, dtype, seed):
    """(q, k, v, do, selection, docs, scale, tolerance) of one case: documents of `lengths` keys whose last
    `counts` tokens (None: all) are the queries; docs the (cu_seqlens, cu_seqlens_q) to pass, () for one row."""
    gen = torch.Generator().manual_seed(seed)
    counts = counts or lengths
    T, Tq = sum(lengths), sum(counts)
    q = torch.randn(1, Tq, H, D, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(1, T, Hkv, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    do = torch.randn(1, Tq, H, D, generator=gen).to(DEVICE, dtype)
    sel = random_selection(lengths, counts, Hkv, lp, n, gen)
    docs = ()
    if len(lengths) > 1 or counts != lengths:
        cu = torch.tensor([0, *accumulate(lengths)], device=DEVICE, dtype=torch.int32)
        cu_q = torch.tensor([0, *accumulate(counts)], device=DEVICE, dtype=torch.int32)
        docs = (cu, None if counts == lengths else cu_q)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    return q, k, v, do, sel, docs, D ** -0.5, tol


@pytest.mark.parametrize("lengths,counts,H,Hkv,D,lp,n,dtype", CASES)
def test_block_major_forward_and_dq_equal_query_major(lengths, counts, H, Hkv, D, lp, n, dtype):
    q, k, v, do, sel, docs, scale, tol = layout_case(lengths, counts, H, Hkv, D, lp, n, dtype,
                                                     seed=len(lengths) * 100 + H)

    o_ref, lse_ref = selected_attention_fwd(q, k, v, sel, lp, scale, *docs)
    for segment in (None, 3):  # one item per list, and lists cut into many items
        o, lse = selected_attention_fwd_blocks(q, k, v, sel, lp, scale, *docs, segment=segment)
        torch.testing.assert_close(lse, lse_ref, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(o, o_ref, **tol)

    grads_ref = selected_attention_bwd(do, q, k, v, o_ref, lse_ref, sel, lp, scale, *docs)
    for segment in (None, 3):
        grads = selected_attention_bwd(do, q, k, v, o_ref, lse_ref, sel, lp, scale, *docs, segment=segment,
                                       dq_layout="block")
        for name, mine, ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            torch.testing.assert_close(mine, ref, **tol, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["one-row", "packed"])
def test_the_op_in_the_block_layout_matches_the_reference(monkeypatch, packed):
    """The op (forward and autograd) follows tile_configs.selected_layout; in the block layout it
    still equals the reference, o and all eight gradients."""
    from components.nsa.triton import ops, selected_attention_bwd as backward, tile_configs
    from tests.test_nsa_packed import ORDER, _grad_out, _documents, _output_and_grads, _packed

    monkeypatch.setattr(tile_configs, "selected_layout_for", lambda *args, **kwargs: "block")
    calls = []

    def spy(name, fn):
        return lambda *args, **kwargs: calls.append(name) or fn(*args, **kwargs)

    monkeypatch.setattr(ops, "selected_attention_fwd_blocks", spy("forward", ops.selected_attention_fwd_blocks))
    monkeypatch.setattr(backward, "_selected_dq", spy("query-major dq", backward._selected_dq))
    docs = _documents([17, 1, 30] if packed else [45], dtype=torch.float32, device=DEVICE)
    inputs, cu_seqlens = _packed(docs)
    cu_seqlens = cu_seqlens if packed else None
    grad_o = _grad_out(docs)
    mine = _output_and_grads(inputs, grad_o, "triton", cu_seqlens)
    reference = _output_and_grads(inputs, grad_o, "reference", cu_seqlens)
    for name, a, b in zip(("o",) + ORDER, mine, reference):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=5e-5, msg=name)
    assert calls == ["forward"]  # the block-major forward ran, and dQ did not take the query-major kernel


def spy_on_layouts(monkeypatch) -> list[str]:
    """The list each selected-branch launch the op makes appends its layout's name to: "forward" (the block
    layout's forward), "query-major dq" (the query layout's dQ) and "masked" (that layout, each way)."""
    from components.nsa.triton import ops, selected_attention_bwd as backward

    calls = []

    def spy(name, fn):
        return lambda *args, **kwargs: calls.append(name) or fn(*args, **kwargs)

    monkeypatch.setattr(ops, "selected_attention_fwd_blocks", spy("forward", ops.selected_attention_fwd_blocks))
    monkeypatch.setattr(backward, "_selected_dq", spy("query-major dq", backward._selected_dq))
    monkeypatch.setattr(ops, "selected_attention_fwd_masked", spy("masked", ops.selected_attention_fwd_masked))
    monkeypatch.setattr(ops, "selected_attention_bwd_masked", spy("masked", ops.selected_attention_bwd_masked))
    return calls


@pytest.mark.parametrize("row_limit, limit, expected",
                         [(0, None, ["forward"]), (0, 0, ["query-major dq"]), (None, None, ["masked", "masked"])],
                         ids=["small-group-block", "over-the-partials-limit-query", "short-row-masked"])
def test_the_default_layout_takes_blocks_for_small_groups_within_the_partials_limit(monkeypatch, row_limit, limit,
                                                                                   expected):
    """Rows of at most MASKED_LAYOUT_MAX_ROW x n x l' keys run masked, forward and backward; longer ones in
    groups of up to BLOCK_LAYOUT_MAX_GROUP heads run block-major, unless the call's partials pass
    BLOCK_LAYOUT_MAX_PARTIAL_BYTES: then the forward and dQ run query-major."""
    from components.nsa.triton import tile_configs
    from tests.test_nsa_packed import H, HKV, HP, _documents, _grad_out, _output_and_grads, _packed

    assert H // HKV <= tile_configs.BLOCK_LAYOUT_MAX_GROUP
    assert 20 <= tile_configs.MASKED_LAYOUT_MAX_ROW * HP["num_selected"] * HP["sel_block_size"]
    if row_limit is not None:
        monkeypatch.setattr(tile_configs, "MASKED_LAYOUT_MAX_ROW", row_limit)
    if limit is not None:
        monkeypatch.setattr(tile_configs, "BLOCK_LAYOUT_MAX_PARTIAL_BYTES", limit)
    calls = spy_on_layouts(monkeypatch)
    docs = _documents([20], dtype=torch.float32, device=DEVICE)
    inputs, _ = _packed(docs)
    _output_and_grads(inputs, _grad_out(docs), "triton", None)
    assert calls == expected


def test_more_entries_than_int32_tables_hold_is_one_clear_error(monkeypatch):
    from components.errors import UserError
    from components.nsa.triton import selection_lists

    monkeypatch.setattr(selection_lists, "MAX_ENTRIES", 100)
    q, k, v = (torch.randn(1, 40, h, 16, device=DEVICE) for h in (2, 1, 1))
    sel = random_selection([40], [40], 1, 8, 3, torch.Generator().manual_seed(0))  # 120 entries
    with pytest.raises(UserError, match="smaller batch or sequence"):
        selected_attention_fwd_blocks(q, k, v, sel, 8, 0.25)
