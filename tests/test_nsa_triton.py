"""The Triton NSA backend against the reference backend, on tiny odd-length problems.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets it), which runs
programs one after another: these tests prove the arithmetic, masking and indexing, not the
absence of races. fp32 and fp16 only: the interpreter's bf16 dot is not faithful.
"""

from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

from components.errors import UserError
from components.nsa import nsa_attention, num_compressed_blocks, select_blocks
from components.nsa.reference import compressed_attention, window_attention
from components.nsa.selection import selection_scores_at
from components.nsa.triton import nsa_attention_triton, select_blocks_triton
from components.nsa.triton.interval_attention import interval_attention_bwd, interval_attention_fwd
from components.nsa.triton.launch import interpreting
from components.nsa.triton.selected_attention_bwd import selected_attention_bwd
from components.nsa.triton.selected_attention_fwd import selected_attention_fwd
from components.nsa.triton.selected_attention_fwd_blocks import selected_attention_fwd_blocks

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()),
    reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (B, T, H, Hkv, D, block_size, block_stride, sel_block_size, num_selected, window_size, dtype)
CASES = [
    pytest.param(2, 37, 1, 1, 16, 8, 4, 16, 3, 10, torch.float32, id="G1-B2-T37-fp32"),
    pytest.param(1, 63, 2, 1, 32, 8, 4, 8, 4, 7, torch.float32, id="G2-T63-fp32"),
    pytest.param(1, 70, 5, 1, 16, 16, 8, 16, 2, 20, torch.float32, id="G5-T70-fp32"),
    pytest.param(1, 63, 5, 1, 16, 8, 4, 16, 3, 12, torch.float16, id="G5-T63-fp16"),
    pytest.param(2, 37, 2, 1, 32, 8, 4, 8, 5, 9, torch.float16, id="G2-B2-T37-fp16"),
    pytest.param(1, 40, 17, 1, 24, 8, 4, 24, 2, 6, torch.float32, id="G17-D24-lsel24-fp32"),
    pytest.param(1, 5, 2, 1, 16, 8, 4, 8, 2, 3, torch.float32, id="T-below-block-Tc0"),
    # Several KV groups: every kernel's group offsets (and the dK/dV bins per group and batch).
    pytest.param(2, 45, 6, 2, 16, 8, 4, 8, 3, 11, torch.float32, id="Hkv2-G3-B2-fp32"),
    pytest.param(1, 52, 3, 3, 16, 8, 4, 16, 2, 10, torch.float16, id="Hkv3-G1-fp16"),
    # fp32 at head dim <= 16 with 64 < l' <= 96: three key sub-tiles of 32 rows, which the dK/dV
    # partial sums must round up to a power of two.
    pytest.param(1, 100, 1, 1, 16, 16, 8, 96, 2, 20, torch.float32, id="lsel96-D16-fp32"),
]


def _hyper(l, d, lp, n, w):
    return dict(block_size=l, block_stride=d, sel_block_size=lp, num_selected=n, window_size=w)


def _make_inputs(B, T, H, Hkv, D, l, d, dtype):
    Tc = num_compressed_blocks(T, l, d)
    shapes = [(B, T, H, D), (B, Tc, Hkv, D), (B, Tc, Hkv, D)] + [(B, T, Hkv, D)] * 4
    xs = [torch.randn(*s, device=DEVICE).to(dtype) for s in shapes]
    xs.append(torch.rand(B, T, H, 3, device=DEVICE).to(dtype))
    return [x.requires_grad_() for x in xs]


def _rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _assert_matches(mine, ref, dtype, what):
    assert mine.shape == ref.shape, what
    assert torch.isfinite(mine).all(), what
    if dtype == torch.float32:
        torch.testing.assert_close(mine.float(), ref.float(), atol=5e-5, rtol=5e-5, msg=what)
    else:  # fp16 rounding of inputs/outputs/probabilities: about half an fp16 epsilon RMS
        assert _rel_rms(mine, ref) < 2e-3, f"{what}: relative RMS error {_rel_rms(mine, ref):.2e}"


def _with_the_gather_layouts_too(cases):
    """Each case as it is (the shipped layout rule), then, where that gives the selected branch its masked layout,
    again with the masked layout off: the gather layouts (block- or query-major by group size) meet the same check."""
    from components.nsa.triton.tile_configs import masked_layout_pays

    shipped = [pytest.param(*c.values, False, id=c.id, marks=c.marks) for c in cases]
    gather = [pytest.param(*c.values, True, id=f"{c.id}-gather", marks=c.marks) for c in cases
              if masked_layout_pays(c.values[1], c.values[8], c.values[7])]
    return shipped + gather


@pytest.mark.parametrize("B,T,H,Hkv,D,l,d,lp,n,w,dtype,gather", _with_the_gather_layouts_too(CASES))
def test_output_and_gradients_match_reference(B, T, H, Hkv, D, l, d, lp, n, w, dtype, gather, monkeypatch):
    if gather:
        from components.nsa.triton import tile_configs

        monkeypatch.setattr(tile_configs, "MASKED_LAYOUT_MAX_ROW", 0)
    hyper = _hyper(l, d, lp, n, w)
    xs = _make_inputs(B, T, H, Hkv, D, l, d, dtype)
    # The reference runs in fp32 on the very same (rounded) values.
    xr = [x.detach().float().requires_grad_() for x in xs]
    sel_hyper = {k: v for k, v in hyper.items() if k != "window_size"}
    assert torch.equal(select_blocks_triton(xs[0].detach(), xs[1].detach(), **sel_hyper),
                       select_blocks(xr[0].detach(), xr[1].detach(), **sel_hyper))

    ref = nsa_attention(*xr, **hyper, backend="reference")
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, xr, grad_out)
    out = nsa_attention(*xs, **hyper, backend="triton")
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, xs, grad_out.to(dtype))

    _assert_matches(out, ref, dtype, "o")
    names = ["dq", "dk_cmp", "dv_cmp", "dk_sel", "dv_sel", "dk_win", "dv_win", "dgates"]
    for name, g, rg in zip(names, grads, ref_grads):
        if rg.numel():
            _assert_matches(g, rg, dtype, name)


SELECTION_CASES = [
    # (T, H, Hkv, D, l, d, lp, n)
    pytest.param(70, 4, 2, 16, 8, 4, 16, 3, id="n3"),
    pytest.param(130, 5, 1, 32, 32, 16, 64, 2, id="paper-blocks-n2"),
    pytest.param(63, 2, 2, 16, 4, 2, 8, 5, id="d2"),
    pytest.param(45, 2, 1, 16, 8, 4, 8, 16, id="n-exceeds-blocks"),
    pytest.param(50, 3, 1, 16, 8, 4, 8, 1, id="n1-forced-order"),
    pytest.param(200, 3, 1, 16, 8, 4, 8, 4, id="several-chunks"),
]


@pytest.mark.parametrize("T,H,Hkv,D,l,d,lp,n", SELECTION_CASES)
def test_selected_blocks_match_reference(T, H, Hkv, D, l, d, lp, n):
    B = 2
    q = torch.randn(B, T, H, D, device=DEVICE)
    k_cmp = torch.randn(B, num_compressed_blocks(T, l, d), Hkv, D, device=DEVICE)
    hyper = dict(block_size=l, block_stride=d, sel_block_size=lp, num_selected=n)
    mine = select_blocks_triton(q, k_cmp, **hyper)
    ref = select_blocks(q, k_cmp, **hyper)
    assert mine.dtype == torch.int64 and mine.shape == ref.shape
    differ = (mine != ref).any(-1)
    if differ.any():  # only allowed where the swapped blocks' scores tie within fp32 rounding
        scores = selection_scores_at(q, k_cmp, q_start=0, block_size=l, block_stride=d, sel_block_size=lp)
        for b, t, g in differ.nonzero().tolist():
            gained = set(mine[b, t, g].tolist()) - set(ref[b, t, g].tolist())
            lost = set(ref[b, t, g].tolist()) - set(mine[b, t, g].tolist())
            row = scores[b, t, g]
            spread = max(abs(row[i] - row[j]).item() for i in gained for j in lost)
            assert spread <= 1e-5 * row.abs().max().item(), (b, t, g, gained, lost)


def test_exact_ties_go_to_the_smaller_block():
    """q = 0: every visible compressed block gets the same probability, so selection blocks covering the
    same compressed blocks tie exactly; the spec picks the smaller j, as the reference does (a kernel that
    broke ties another way would pass the random-input test above, whose scores never tie)."""
    T, H, Hkv, D, l, d, lp, n = 120, 2, 1, 16, 8, 4, 8, 4
    q = torch.zeros(1, T, H, D, device=DEVICE)
    k_cmp = torch.randn(1, num_compressed_blocks(T, l, d), Hkv, D, device=DEVICE)
    hyper = dict(block_size=l, block_stride=d, sel_block_size=lp, num_selected=n)
    ref = select_blocks(q, k_cmp, **hyper)
    assert torch.equal(select_blocks_triton(q, k_cmp, **hyper), ref)
    # The ties are real: at the last query, the middle blocks' scores are all equal.
    scores = selection_scores_at(q, k_cmp, q_start=0, block_size=l, block_stride=d, sel_block_size=lp)[0, -1, 0]
    assert torch.equal(scores[2:8], scores[2:3].expand(6))


def test_selection_layout():
    """Ascending block ids, -1 only after the used slots, forced blocks always present."""
    T, lp, n = 70, 8, 4
    q = torch.randn(1, T, 2, 16, device=DEVICE)
    k_cmp = torch.randn(1, num_compressed_blocks(T, 8, 4), 1, 16, device=DEVICE)
    sel = select_blocks_triton(q, k_cmp, block_size=8, block_stride=4, sel_block_size=lp, num_selected=n)[0, :, 0]
    for t in range(T):
        row = sel[t].tolist()
        used = [j for j in row if j >= 0]
        assert row == used + [-1] * (n - len(used))
        assert used == sorted(set(used)) and len(used) == min(n, t // lp + 1)
        assert {0, t // lp, max(0, t // lp - 1)} <= set(used)


@pytest.mark.parametrize("lengths", [[40], [17, 1, 22]], ids=["one-row", "packed"])
def test_selected_dkdv_work_items_sum_to_the_same_gradients(lengths):
    """Cutting long query lists into many work items (block 0's list holds every query) only
    regroups fp32 sums; packed documents number their key blocks one document after another."""
    B, T, H, Hkv, D, l, d, lp, n = 1, sum(lengths), 2, 1, 16, 8, 4, 8, 3
    q, k, v = (torch.randn(B, T, h, D, device=DEVICE) for h in (H, Hkv, Hkv))
    k_cmp = torch.randn(B, sum(num_compressed_blocks(t, l, d) for t in lengths), Hkv, D, device=DEVICE)
    cu_seqlens = torch.tensor([0, *accumulate(lengths)], device=DEVICE) if len(lengths) > 1 else None
    sel = select_blocks(q, k_cmp, block_size=l, block_stride=d, sel_block_size=lp, num_selected=n,
                        cu_seqlens=cu_seqlens)
    scale = D**-0.5
    o, lse2 = selected_attention_fwd(q, k, v, sel, lp, scale, cu_seqlens)
    do = torch.randn_like(o)
    whole = selected_attention_bwd(do, q, k, v, o, lse2, sel, lp, scale, cu_seqlens)
    for segment in (5, 16):
        split = selected_attention_bwd(do, q, k, v, o, lse2, sel, lp, scale, cu_seqlens, segment=segment)
        for a, b in zip(split, whole):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("branch", ["compressed", "window"])
@pytest.mark.parametrize("per_head, split_queries", [(False, None), (True, None), (False, 7), (True, 4)],
                         ids=["group-per-program", "head-per-program", "group-query-splits", "head-query-splits"])
def test_interval_branches_both_dkdv_splits_match_reference(branch, per_head, split_queries):
    """dK/dV by KV group or by query head, over all the queries that see a key tile or in runs of them."""
    B, T, H, Hkv, D, l, d, w = 1, 45, 6, 2, 16, 8, 4, 11
    Tk = num_compressed_blocks(T, l, d) if branch == "compressed" else T
    q = torch.randn(B, T, H, D, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, Tk, Hkv, D, device=DEVICE, requires_grad=True) for _ in range(2))
    if branch == "compressed":
        ref = compressed_attention(q, k, v, q_start=0, block_size=l, block_stride=d)
        mask = (d, l - 1, 0)
    else:
        ref = window_attention(q, k, v, q_start=0, window_size=w)
        mask = (1, 0, w)
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    o, lse2 = interval_attention_fwd(q.detach(), k.detach(), v.detach(), *mask, D**-0.5)
    grads = interval_attention_bwd(do, q.detach(), k.detach(), v.detach(), o, lse2, *mask, D**-0.5, per_head=per_head,
                                   split_queries=split_queries)
    for name, mine, theirs in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(mine, theirs, atol=5e-5, rtol=5e-5, msg=name)


@pytest.mark.parametrize("branch", ["compressed", "window"])
@pytest.mark.parametrize("per_head, split_queries", [(False, None), (True, None), (True, 3)],
                         ids=["group-per-program", "head-per-program", "head-query-splits"])
def test_interval_branches_on_packed_documents_equal_each_document_alone(branch, per_head, split_queries):
    """cu_seqlens: outputs, lse2 and gradients of a packed row are those of its documents run one by
    one (one shorter than a compressed block, one of a single token), with every dK/dV split."""
    lengths, H, Hkv, D, l, d, w = [13, 1, 5, 30], 4, 2, 16, 8, 4, 7
    keys = [num_compressed_blocks(n, l, d) if branch == "compressed" else n for n in lengths]
    mask = (d, l - 1, 0) if branch == "compressed" else (1, 0, w)
    q, do = (torch.randn(1, sum(lengths), H, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(1, sum(keys), Hkv, D, device=DEVICE) for _ in range(2))
    token_starts, key_starts = [0, *accumulate(lengths)], [0, *accumulate(keys)]
    cu_seqlens = torch.tensor(token_starts, device=DEVICE)

    def run(q, k, v, do, cu_seqlens=None):
        o, lse2 = interval_attention_fwd(q, k, v, *mask, D**-0.5, cu_seqlens)
        return [o, lse2.transpose(1, 2), *interval_attention_bwd(do, q, k, v, o, lse2, *mask, D**-0.5, cu_seqlens,
                                                                   per_head=per_head, split_queries=split_queries)]

    packed = run(q, k, v, do, cu_seqlens)
    parts = [run(q[:, t0:t1], k[:, k0:k1], v[:, k0:k1], do[:, t0:t1])
             for t0, t1, k0, k1 in zip(token_starts, token_starts[1:], key_starts, key_starts[1:])]
    for name, mine, alone in zip(("o", "lse2", "dq", "dk", "dv"), packed, zip(*parts)):
        torch.testing.assert_close(mine, torch.cat(alone, dim=1), atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("branch", ["selected", "window"])
def test_full_coverage_equals_dense_causal_attention(branch):
    """n >= Ts makes the selected branch, w >= T the window branch, plain causal attention."""
    B, T, H, Hkv, D = 1, 40, 2, 1, 16
    xs = _make_inputs(B, T, H, Hkv, D, 8, 4, torch.float32)
    gate = torch.tensor([0.0, 1.0, 0.0] if branch == "selected" else [0.0, 0.0, 1.0], device=DEVICE)
    xs[7] = gate.expand(B, T, H, 3).clone().requires_grad_()
    # T = 40 has Ts = 5 selection blocks of 8 tokens.
    hyper = _hyper(8, 4, 8, 5, 3) if branch == "selected" else _hyper(8, 4, 8, 2, T)
    out = nsa_attention_triton(*xs, **hyper)
    k, v = (xs[3], xs[4]) if branch == "selected" else (xs[5], xs[6])
    dense = F.scaled_dot_product_attention(
        xs[0].transpose(1, 2), k.repeat_interleave(H // Hkv, 2).transpose(1, 2),
        v.repeat_interleave(H // Hkv, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, dense, atol=5e-5, rtol=5e-5)


def test_every_launch_fits_cuda_grid_limits(monkeypatch):
    """70000 (batch x KV head) rows: more than CUDA's 65535 on grid axes 1 and 2, so every launcher
    must put them on axis 0 (limit 2^31 - 1). Launches are recorded, not run: under the interpreter
    and on a GPU alike (kernels are then JIT functions)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    grids = {}

    def record(self, *args, grid, warmup, **kwargs):
        grids[self.fn.__name__] = grid(kwargs) if callable(grid) else grid

    monkeypatch.setattr(InterpretedFunction, "run", record)
    monkeypatch.setattr(JITFunction, "run", record)
    B, T, D, lp = 70_000, 2, 16, 16
    q, k, v, do = (torch.randn(B, T, 1, D, device=DEVICE) for _ in range(4))
    sel = torch.zeros(B, T, 1, 1, dtype=torch.int64, device=DEVICE)
    o, lse2 = interval_attention_fwd(q, k, v, 1, 0, 2, 0.25)
    interval_attention_bwd(do, q, k, v, o, lse2, 1, 0, 2, 0.25)
    select_blocks_triton(q, k[:, :0], block_size=8, block_stride=4, sel_block_size=lp, num_selected=1)
    o, lse2 = selected_attention_fwd(q, k, v, sel, lp, 0.25)
    selected_attention_fwd_blocks(q, k, v, sel, lp, 0.25)
    for dq_layout in ("query", "block"):
        selected_attention_bwd(do, q, k, v, o, lse2, sel, lp, 0.25, dq_layout=dq_layout)
    assert len(grids) == 12, sorted(grids)  # every kernel of the forward and backward, both selected layouts
    for name, grid in grids.items():
        grid = tuple(grid) + (1,) * (3 - len(grid))
        assert grid[0] <= 2**31 - 1 and grid[1] <= 65535 and grid[2] <= 65535, (name, grid)


@pytest.mark.parametrize("dtype, D, lp", [(torch.float32, 64, 64), (torch.float16, 64, 128), (torch.float16, 32, 32)],
                         ids=["fp32-4-key-subtiles", "half-2-key-subtiles", "forward-partials-larger"])
def test_the_block_layouts_partials_are_what_its_budget_counts(monkeypatch, dtype, D, lp):
    """block_layout_partial_bytes (which picks the layout and sizes doctor's estimate) is the larger of the
    forward's partials and the backward's dQ partials, one per key sub-tile of a selection block."""
    from components.nsa.triton import selected_attention_bwd as bwd_module, selected_attention_fwd_blocks as fwd_module
    from components.nsa.triton.tile_configs import block_layout_partial_bytes

    B, T, H, Hkv, n = 1, 256, 4, 2, 2
    q, do = (torch.randn(B, T, H, D, dtype=dtype, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, T, Hkv, D, dtype=dtype, device=DEVICE) for _ in range(2))
    latest = (torch.arange(T, device=DEVICE) // lp).view(1, T, 1, 1).expand(B, T, Hkv, 1)
    sel = torch.cat([torch.zeros_like(latest), latest], dim=-1)
    allocated = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        made = empty(*args, **kwargs)
        if made.dtype == torch.float32 and tuple(made.shape) != (B, H, T):  # not lse2 or delta
            allocated.append(made.nbytes)
        return made

    monkeypatch.setattr(fwd_module.torch, "empty", recording_empty)
    o, lse2 = selected_attention_fwd_blocks(q, k, v, sel, lp, D**-0.5)
    forward, allocated[:] = sum(allocated), []
    bwd_module.selected_attention_bwd(do, q, k, v, o, lse2, sel, lp, D**-0.5, dq_layout="block")
    assert block_layout_partial_bytes(B * T, H, n, D, lp, q.element_size()) == max(forward, max(allocated))


def test_rejects_float64():
    xs = _make_inputs(1, 16, 2, 1, 16, 8, 4, torch.float64)
    with pytest.raises(UserError, match="float64"):
        nsa_attention(*xs, **_hyper(8, 4, 8, 2, 4), backend="triton")
