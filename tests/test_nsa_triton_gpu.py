"""The Triton NSA backend on a CUDA GPU: bf16 at 2k-32k tokens against the fp32 reference.

Each comparison feeds the reference the same bf16 values upcast to fp32. Selection is checked on
its own (equal sets up to fp32 ties); the attention checks then reuse the kernel's selection, so
a near-tie flip in one row cannot hide or fake an error elsewhere. Packed rows (cu_seqlens): a 32k
row of documents 1k-8k tokens long against the reference run on each document.
"""

import pytest
import torch

from bench.attention import cu_seqlens_of, packed_lengths
from components.nsa import nsa_attention, num_compressed_blocks, select_blocks
from components.nsa.documents import document_slices
from components.nsa.reference import compressed_attention, selected_attention, window_attention
from components.nsa.selection import selection_scores_at
from components.nsa.triton import nsa_attention_triton, ops, select_blocks_triton
from components.nsa.triton.selected_attention_masked import selected_attention_fwd_masked

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 kernels at 2k-32k tokens)"),
]

HYPER = dict(block_size=32, block_stride=16, sel_block_size=64, num_selected=16, window_size=512)
SEL_HYPER = {k: v for k, v in HYPER.items() if k != "window_size"}
# (T, H, Hkv, D): the paper's group size 16 at 2k, the 125M recipes' layout (12 / 4: a group of 3, padded
# to 4 in the block layout's forward, packed back to back in its dK/dV) at 8k, then a group of 4 at 32k,
# keeping the reference's time sane.
SIZES = [
    pytest.param(2048, 16, 1, 128, id="T2k-G16-D128"),
    pytest.param(8192, 12, 4, 64, id="T8k-G3-D64"),
    pytest.param(32768, 8, 2, 128, id="T32k-G4-D128"),
]
TOLERANCE = 5e-3  # relative RMS error, bf16 kernels vs fp32 reference
# A row (the last dim: a query's output or gradient, a key's gradient) wrong where the rest is right barely moves
# the whole tensor's RMS (one query of 2,048 20% off: 0.4% of it). Each row's error against its own norm (or a
# tenth of a typical row's, for rows near zero) is held to ROW_TOLERANCE too: bf16 rounding stays near 1%.
ROW_TOLERANCE = 0.1


def _inputs(T, H, Hkv, D, B=1, requires_grad=True, lengths=None):
    """Random bf16 inputs; with document lengths (B = 1), k_cmp / v_cmp hold the documents' blocks."""
    Tc = sum(num_compressed_blocks(n, HYPER["block_size"], HYPER["block_stride"]) for n in (lengths or [T]))
    shapes = [(B, T, H, D), (B, Tc, Hkv, D), (B, Tc, Hkv, D)] + [(B, T, Hkv, D)] * 4
    xs = [torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    xs.append(torch.rand(B, T, H, 3, device="cuda", dtype=torch.bfloat16))
    return [x.requires_grad_(requires_grad) for x in xs]


def _fp32_copies(xs):
    return [x.detach().float().requires_grad_() for x in xs]


def _rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _worst_row_error(a, b):
    """The largest error of a row of a (last dim) against b's row norm, floored at a tenth of b's RMS row norm."""
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    norms = b.norm(dim=-1)
    floor = 0.1 * norms.pow(2).mean().sqrt().clamp_min(1e-30)
    return ((a - b).norm(dim=-1) / norms.clamp_min(floor)).max().item() if norms.numel() else 0.0


def _assert_close(mine, ref, what):
    assert torch.isfinite(mine).all(), what
    err = _rel_rms(mine, ref)
    assert err < TOLERANCE, f"{what}: relative RMS error {err:.2e}"
    worst = _worst_row_error(mine, ref)
    assert worst < ROW_TOLERANCE, f"{what}: a row's relative error {worst:.2e} (the whole tensor's RMS {err:.2e})"


def _assert_equal_up_to_ties(mine, ref, scores_of):
    """Few rows differ, and where they do the swapped blocks' scores tie within fp32 rounding;
    scores_of(t) gives (group scores [B, T', Hkv, Ts] of t's document, t's row in them)."""
    differ = (mine != ref).any(-1)
    rows = differ.nonzero().tolist()
    assert len(rows) <= max(8, differ.numel() // 1000), f"{len(rows)} of {differ.numel()} rows differ"
    for b, t, g in rows:
        gained = set(mine[b, t, g].tolist()) - set(ref[b, t, g].tolist())
        lost = set(ref[b, t, g].tolist()) - set(mine[b, t, g].tolist())
        scores, row_t = scores_of(t)
        row = scores[b, row_t, g]
        spread = max(abs(row[i] - row[j]).item() for i in gained for j in lost)
        assert spread <= 5e-5 * row.abs().max().item(), (b, t, g, gained, lost)


def _scores(q, k_cmp):
    return selection_scores_at(q.float(), k_cmp.float(), q_start=0, **{k: SEL_HYPER[k] for k in
                                                                      ("block_size", "block_stride", "sel_block_size")})


@pytest.mark.parametrize("T,H,Hkv,D", SIZES)
def test_selection_matches_reference_up_to_ties(T, H, Hkv, D):
    q, k_cmp = _inputs(T, H, Hkv, D, requires_grad=False)[:2]
    mine = select_blocks_triton(q, k_cmp, **SEL_HYPER)
    ref = select_blocks(q.float(), k_cmp.float(), **SEL_HYPER)
    _assert_equal_up_to_ties(mine, ref, lambda t: (_scores(q, k_cmp), t))


@pytest.mark.parametrize("T,H,Hkv,D", SIZES)
def test_each_branch_matches_reference(T, H, Hkv, D):
    _assert_branches_match_reference(*_inputs(T, H, Hkv, D)[:7])


@pytest.mark.parametrize("T,H,Hkv,D", [pytest.param(8192, 12, 4, 64, id="T8k-G3-D64"),
                                        pytest.param(32768, 12, 4, 64, id="T32k-G3-D64"),
                                        pytest.param(8192, 8, 2, 128, id="T8k-G4-D128"),
                                        pytest.param(4096, 8, 2, 256, id="T4k-G4-D256")])
def test_branches_match_reference_in_the_selected_block_layout(T, H, Hkv, D, monkeypatch):
    """The 125M head layout (G = 3) with the selected branch's block-major forward and dQ, and the
    wider heads whose dK/dV tiles (and its dQ share, k^T.dS^T) build differently."""
    from components.nsa.triton import tile_configs

    monkeypatch.setattr(tile_configs, "selected_layout_for", lambda *args, **kwargs: "block")
    _assert_branches_match_reference(*_inputs(T, H, Hkv, D)[:7])


@pytest.mark.parametrize("T,H,Hkv,D", [pytest.param(2048, 16, 1, 128, id="T2k-G16-D128"),
                                        pytest.param(8192, 12, 4, 64, id="T8k-G3-D64"),
                                        pytest.param(None, None, None, None, id="packed")])
def test_branches_match_reference_in_the_selected_query_layout(T, H, Hkv, D, monkeypatch):
    """Query-major forward and dQ, which the default gives groups of more than 4 heads past the masked layout's
    rows (the paper's heads at 8k and 64k), forced: the paper's group at 2k, the 125M heads, packed documents."""
    from components.nsa.triton import tile_configs

    monkeypatch.setattr(tile_configs, "selected_layout_for", lambda *args, **kwargs: "query")
    xs, cu_seqlens = _packed_row() if T is None else (_inputs(T, H, Hkv, D), None)
    _assert_branches_match_reference(*xs[:7], cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("T,H,Hkv,D", [pytest.param(8192, 12, 4, 64, id="T8k-G3-D64"),
                                        pytest.param(4096, 8, 2, 256, id="T4k-G4-D256"),
                                        pytest.param(None, None, None, None, id="packed")])
def test_branches_match_reference_in_the_selected_masked_layout(T, H, Hkv, D, monkeypatch):
    """The selected branch as causal flash attention hiding unselected blocks (selection_mask.py), forced: the 125M
    heads at 8k and the packed 32k row (the default takes the gather layouts there: rows of more than 4 x n x l' =
    4,096 keys), the widest heads at 4k."""
    from components.nsa.triton import tile_configs

    monkeypatch.setattr(tile_configs, "selected_layout_for", lambda *args, **kwargs: "masked")
    xs, cu_seqlens = _packed_row() if T is None else (_inputs(T, H, Hkv, D), None)
    _assert_branches_match_reference(*xs[:7], cu_seqlens=cu_seqlens)


def _assert_branches_match_reference(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, cu_seqlens=None):
    """Each branch's op (o, dq, dk, dv) against the reference with the kernel's selection; with
    cu_seqlens, the reference runs on each document alone."""
    scale = q.shape[-1] ** -0.5
    l, d, lp, w = HYPER["block_size"], HYPER["block_stride"], HYPER["sel_block_size"], HYPER["window_size"]
    selection = select_blocks_triton(q.detach(), k_cmp.detach(), **SEL_HYPER, cu_seqlens=cu_seqlens)

    def on_rows(fn, token_args, block_args=()):
        """fn on the row, or on each document's slices of its arguments (tokens, then compressed blocks)."""
        if cu_seqlens is None:
            return fn(*token_args, *block_args)
        return _per_document(fn, cu_seqlens, token_args, block_args)

    def cmp(a, b, c):
        return compressed_attention(a, b, c, q_start=0, block_size=l, block_stride=d)

    def sel(a, b, c, s):
        return selected_attention(a, b, c, s, q_start=0, sel_block_size=lp)

    def win(a, b, c):
        return window_attention(a, b, c, q_start=0, window_size=w)

    branches = {
        "cmp": ((q, k_cmp, v_cmp), lambda a, b, c: ops.interval_attention(a, b, c, d, l - 1, 0, scale, cu_seqlens)[0],
                lambda a, b, c: on_rows(cmp, (a,), (b, c))),
        "sel": ((q, k_sel, v_sel), lambda a, b, c: ops.selected_attention(a, b, c, selection, lp, scale, cu_seqlens)[0],
                lambda a, b, c: on_rows(sel, (a, b, c, selection))),
        "win": ((q, k_win, v_win), lambda a, b, c: ops.interval_attention(a, b, c, 1, 0, w, scale, cu_seqlens)[0],
                lambda a, b, c: on_rows(win, (a, b, c))),
    }
    for name, (xs, kernel, on_reference) in branches.items():
        xr = _fp32_copies(xs)
        ref = on_reference(*xr)
        grad_out = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, xr, grad_out)
        out = kernel(*xs)
        grads = torch.autograd.grad(out, xs, grad_out.bfloat16())
        _assert_close(out, ref, f"o_{name}")
        for gname, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
            _assert_close(g, rg, f"{gname}_{name}")


@pytest.mark.parametrize("T,H,Hkv,D", SIZES[:2])
def test_whole_op_matches_reference_with_the_same_selection(T, H, Hkv, D):
    xs = _inputs(T, H, Hkv, D)
    xr = _fp32_copies(xs)
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = xr
    l, d, lp, w = HYPER["block_size"], HYPER["block_stride"], HYPER["sel_block_size"], HYPER["window_size"]
    selection = select_blocks_triton(xs[0].detach(), xs[1].detach(), **SEL_HYPER)
    g = gates.unsqueeze(-1)
    ref = (g[..., 0, :] * compressed_attention(q, k_cmp, v_cmp, q_start=0, block_size=l, block_stride=d)
           + g[..., 1, :] * selected_attention(q, k_sel, v_sel, selection, q_start=0, sel_block_size=lp)
           + g[..., 2, :] * window_attention(q, k_win, v_win, q_start=0, window_size=w))
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, xr, grad_out)
    out = nsa_attention(*xs, **HYPER, backend="triton")
    grads = torch.autograd.grad(out, xs, grad_out.bfloat16())
    _assert_close(out, ref, "o")
    names = ["dq", "dk_cmp", "dv_cmp", "dk_sel", "dv_sel", "dk_win", "dv_win", "dgates"]
    for name, gr, rg in zip(names, grads, ref_grads):
        _assert_close(gr, rg, name)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["query", "block", "masked"])
def test_backward_is_deterministic_and_sync_free(layout, D, monkeypatch):
    """Bitwise equal twice: a race inside a kernel (a compiler's pipelining included) shows here."""
    from components.nsa.triton import tile_configs

    monkeypatch.setattr(tile_configs, "selected_layout_for", lambda *args, **kwargs: layout)
    xs = _inputs(4096, 16, 2, D)
    grad_out = torch.randn(1, 4096, 16, D, device="cuda", dtype=torch.bfloat16)
    out = nsa_attention_triton(*xs, **HYPER)  # compile every kernel outside the checked region
    torch.autograd.grad(out, xs, grad_out)
    torch.cuda.synchronize()
    runs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            out = nsa_attention_triton(*xs, **HYPER)
            runs.append([out] + list(torch.autograd.grad(out, xs, grad_out)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_inductor_fullgraph_matches_eager():
    torch._dynamo.reset()
    xs = _inputs(2048, 8, 2, 64)
    grad_out = torch.randn(1, 2048, 8, 64, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        out = fn(*xs)
        return [out] + list(torch.autograd.grad(out, xs, grad_out))

    eager = run(lambda *a: nsa_attention_triton(*a, **HYPER))
    compiled = run(torch.compile(lambda *a: nsa_attention_triton(*a, **HYPER), fullgraph=True))
    for a, b in zip(compiled, eager):  # same kernels; only the fused fp32 gating may round differently
        assert _rel_rms(a, b) < 2e-3


def test_inductor_fullgraph_packed_rows_with_max_seqlen_match_eager(monkeypatch):
    """The model's call: 4 rows of 2k as one packed row with max_seqlen = 2048 (the masked layout), compiled with
    the default backend at two lengths (the second symbolic), forward and backward equal to eager."""
    from components.nsa import nsa_attention
    from components.nsa.triton import ops

    torch._dynamo.reset()
    masked = []
    monkeypatch.setattr(ops, "selected_attention_fwd_masked",
                        lambda *a, **k: masked.append(1) or selected_attention_fwd_masked(*a, **k))
    compiled_fn = torch.compile(lambda *a, **k: nsa_attention(*a, **k), fullgraph=True)
    for rows in (4, 3):
        T = 2048
        xs = _inputs(rows * T, 8, 2, 64, lengths=[T] * rows)
        cu_seqlens = torch.arange(0, rows * T + 1, T, device="cuda", dtype=torch.int32)
        grad_out = torch.randn(1, rows * T, 8, 64, device="cuda", dtype=torch.bfloat16)

        def run(fn):
            out = fn(*xs, **HYPER, backend="triton", cu_seqlens=cu_seqlens, max_seqlen=T)
            return [out] + list(torch.autograd.grad(out, xs, grad_out))

        eager = run(nsa_attention)
        compiled = run(compiled_fn)
        for a, b in zip(compiled, eager):  # same kernels; only the fused fp32 gating may round differently
            assert _rel_rms(a, b) < 2e-3
    assert len(masked) == 4  # the masked layout's forward, eager and compiled, at both lengths


def test_offsets_beyond_int32():
    """q with more than 2**31 elements: window branch forward and backward on the last queries."""
    T, H, Hkv, D, w = 65536, 256, 8, 128, 64
    # Free, not total, memory: other test workers and the GPU suite's training groups share the GPU.
    torch.cuda.empty_cache()  # this worker's own cached blocks are free to it
    free = torch.cuda.mem_get_info()[0]
    if free < 48 * 2**30:
        pytest.skip(f"needs 48 GiB of free GPU memory (the tensors and their gradients take about 40 GiB), "
                    f"{free / 2**30:.1f} GiB free now")
    q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    assert q.numel() >= 2**31
    k, v = (torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    o, _ = ops.interval_attention(q, k, v, 1, 0, w, D**-0.5)
    grad_out = torch.zeros_like(o)
    tail = 128
    grad_out[:, T - tail:] = torch.randn(1, tail, H, D, device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), grad_out)

    # The same window attention for the last `tail` queries, directly in fp32.
    k0 = T - tail - w
    qs = q.detach()[:, T - tail:].float().requires_grad_()
    ks, vs = (x.detach()[:, k0:].float().requires_grad_() for x in (k, v))
    scores = torch.einsum("bthd,bshd->bhts", qs, ks.repeat_interleave(H // Hkv, 2)) * D**-0.5
    t = torch.arange(T - tail, T, device="cuda")[:, None]
    s = torch.arange(k0, T, device="cuda")[None, :]
    scores = scores.masked_fill(~((s <= t) & (s > t - w)), float("-inf"))
    ref = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), vs.repeat_interleave(H // Hkv, 2))
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (qs, ks, vs), grad_out[:, T - tail:].float())
    _assert_close(o[:, T - tail:], ref, "o tail")
    _assert_close(dq[:, T - tail:], ref_dq, "dq tail")
    _assert_close(dk[:, T - tail:], ref_dk[:, w:], "dk tail")
    _assert_close(dv[:, T - tail:], ref_dv[:, w:], "dv tail")


# A packed row: documents 1k-8k tokens long filling 32k tokens (seeded lengths).
PACKED_T, PACKED_HEADS = 32768, (8, 2, 128)


def _packed_row():
    lengths = packed_lengths(PACKED_T, 1024, 8192)
    cu_seqlens = cu_seqlens_of(lengths)
    return _inputs(PACKED_T, *PACKED_HEADS, lengths=lengths), cu_seqlens


def _per_document(fn, cu_seqlens, token_tensors, block_tensors=()):
    """fn(*token slices, *block slices) for each document, concatenated along dim 1."""
    slices = document_slices(cu_seqlens, PACKED_T, HYPER["block_size"], HYPER["block_stride"])
    return torch.cat([fn(*(x[:, tokens] for x in token_tensors), *(x[:, blocks] for x in block_tensors))
                      for tokens, blocks in slices], dim=1)


def test_packed_selection_matches_reference_up_to_ties():
    xs, cu_seqlens = _packed_row()
    q, k_cmp = xs[0].detach(), xs[1].detach()
    mine = select_blocks_triton(q, k_cmp, **SEL_HYPER, cu_seqlens=cu_seqlens)
    ref = select_blocks(q.float(), k_cmp.float(), **SEL_HYPER, cu_seqlens=cu_seqlens)
    starts = cu_seqlens.tolist()

    def scores_of(t):  # the scores of t's own document
        k = max(i for i, a in enumerate(starts[:-1]) if a <= t)
        tokens, blocks = document_slices(cu_seqlens, PACKED_T, HYPER["block_size"], HYPER["block_stride"])[k]
        return _scores(q[:, tokens], k_cmp[:, blocks]), t - starts[k]

    _assert_equal_up_to_ties(mine, ref, scores_of)


def test_packed_branches_match_reference():
    """Each branch with cu_seqlens against the reference run on each document (same selection)."""
    xs, cu_seqlens = _packed_row()
    _assert_branches_match_reference(*xs[:7], cu_seqlens=cu_seqlens)


# Documents 1k-8k tokens long, two of them not a multiple of any block size.
PACKED_LENGTHS = (4096, 1024, 8192, 2555, 6144, 1536, 7168, 2053)


def test_packed_documents_match_the_reference_document_by_document():
    """cu_seqlens on the Triton backend in bf16: each document's outputs and gradients against the fp32
    reference of that document alone, with the kernel's own selection (as the whole-op test does)."""
    H, Hkv, D = 8, 2, 64
    l, d, lp, w = HYPER["block_size"], HYPER["block_stride"], HYPER["sel_block_size"], HYPER["window_size"]
    docs = [_inputs(n, H, Hkv, D, requires_grad=False) for n in PACKED_LENGTHS]
    xs = [torch.cat([doc[i] for doc in docs], dim=1).requires_grad_() for i in range(8)]
    cu_seqlens = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], device="cuda")
    out = nsa_attention(*xs, **HYPER, backend="triton", cu_seqlens=cu_seqlens)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, xs, grad_out)

    refs, ref_grads = [], []
    starts = cu_seqlens.tolist()
    for doc, a, b in zip(docs, starts, starts[1:]):
        xr = _fp32_copies(doc)
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = xr
        selection = select_blocks_triton(doc[0], doc[1], **SEL_HYPER)
        g = gates.unsqueeze(-1)
        ref = (g[..., 0, :] * compressed_attention(q, k_cmp, v_cmp, q_start=0, block_size=l, block_stride=d)
               + g[..., 1, :] * selected_attention(q, k_sel, v_sel, selection, q_start=0, sel_block_size=lp)
               + g[..., 2, :] * window_attention(q, k_win, v_win, q_start=0, window_size=w))
        refs.append(ref)
        ref_grads.append(torch.autograd.grad(ref, xr, grad_out[:, a:b].float()))
    _assert_close(out, torch.cat(refs, dim=1), "o")
    names = ["dq", "dk_cmp", "dv_cmp", "dk_sel", "dv_sel", "dk_win", "dv_win", "dgates"]
    for i, name in enumerate(names):
        _assert_close(grads[i], torch.cat([r[i] for r in ref_grads], dim=1), name)


@pytest.mark.parametrize("masked", [False, True], ids=["gather", "masked"])
def test_query_offsets_match_the_full_packed_op(masked, monkeypatch):
    """Context parallelism's form (cu_seqlens_q): each document's last third of queries, as a cp
    rank's chunk holds them, gives the full packed op's outputs and gradients at those positions; in the
    gather layouts the row's length picks, and in the masked layout (its rows stretched to the longest
    document's 8k, max_seqlen that length, as the model passes its rows')."""
    from components.nsa.triton import tile_configs
    from tests.test_nsa_triton_block_major import spy_on_layouts

    xs, cu_seqlens = _packed_row()
    hint = {}
    if masked:
        monkeypatch.setattr(tile_configs, "MASKED_LAYOUT_MAX_ROW", 8)  # 8 x n x l' = 8,192 keys
        hint = {"max_seqlen": int(cu_seqlens.diff().max())}
    calls = spy_on_layouts(monkeypatch)
    cu_seqlens = cu_seqlens.cuda()
    ends = cu_seqlens[1:].tolist()
    counts = [max(1, n // 3) for n in cu_seqlens.diff().tolist()]
    keep = torch.cat([torch.arange(e - c, e) for e, c in zip(ends, counts)]).cuda()
    cu_seqlens_q = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device="cuda")
    full = nsa_attention(*xs, **HYPER, backend="triton", cu_seqlens=cu_seqlens)
    grad_kept = torch.randn(1, len(keep), *full.shape[2:], device="cuda", dtype=torch.bfloat16)
    expected = [full[:, keep], *torch.autograd.grad(full, xs, torch.zeros_like(full).index_copy(1, keep, grad_kept))]
    queries = (0, 7)  # q and gates hold only the kept queries
    leaves = [x.detach()[:, keep] if i in queries else x.detach() for i, x in enumerate(xs)]
    leaves = [x.requires_grad_() for x in leaves]
    calls.clear()
    out = nsa_attention(*leaves, **HYPER, backend="triton", cu_seqlens=cu_seqlens, cu_seqlens_q=cu_seqlens_q, **hint)
    got = [out, *torch.autograd.grad(out, leaves, grad_kept)]
    assert ("masked" in calls) == masked, calls
    names = ["o", "dq", "dk_cmp", "dv_cmp", "dk_sel", "dv_sel", "dk_win", "dv_win", "dgates"]
    for index, (name, mine, theirs) in enumerate(zip(names, got, expected)):
        _assert_close(mine, theirs[:, keep] if index - 1 in queries else theirs, name)
