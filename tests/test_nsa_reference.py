"""The NSA reference op against per-token brute force, dense attention, and the spec's properties."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import components.nsa.chunked_attention as chunked_attention
from components.errors import UserError
from components.nsa import BACKENDS, nsa_attention, nsa_attention_at, select_blocks
from components.nsa.reference import compressed_attention, nsa_attention_at_reference, selected_attention
from components.nsa.reference import window_attention
from tests.test_nsa_bruteforce import (
    HYPER_NAMES,
    brute_force_nsa,
    count_compressed_blocks,
    dense_causal_attention,
    make_inputs,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def hyper(l, d, lp, n, w):
    return dict(zip(HYPER_NAMES, (l, d, lp, n, w), strict=True))


def run(inputs, hp, **kw):
    return nsa_attention(**inputs, **hp, **kw)


def with_gates(inputs, branch):
    """Inputs whose gates pick one branch: 0 = compressed, 1 = selected, 2 = window."""
    gates = torch.zeros_like(inputs["gates"])
    gates[..., branch] = 1.0
    return dict(inputs, gates=gates)


def prefix(inputs, hp, Tk):
    """The inputs a cache holding the first Tk tokens would pass."""
    Tc = count_compressed_blocks(Tk, hp["block_size"], hp["block_stride"])
    out = {k: v[:, :Tk] for k, v in inputs.items() if k not in ("k_cmp", "v_cmp")}
    out.update(k_cmp=inputs["k_cmp"][:, :Tc], v_cmp=inputs["v_cmp"][:, :Tc])
    return out


ORACLE_CASES = [
    # (B, T, H, Hkv, D, hyperparameters): lengths that are no multiple of l, d or l' where the
    # stride allows, G = 1, 2, 3, 6, 16, 20, Tc = 0 (T < l), n = 1, w > T.
    (2, 63, 2, 1, 4, hyper(8, 4, 16, 3, 10)),
    (1, 111, 6, 1, 3, hyper(8, 4, 16, 4, 20)),
    (1, 51, 20, 1, 2, hyper(4, 2, 8, 5, 7)),
    (2, 37, 4, 4, 3, hyper(6, 3, 12, 2, 5)),
    (1, 70, 16, 1, 2, hyper(8, 8, 8, 1, 3)),
    (1, 47, 6, 2, 3, hyper(6, 2, 18, 2, 64)),
    (2, 5, 2, 1, 4, hyper(8, 4, 16, 3, 2)),
]


@pytest.mark.parametrize("chunk_rows", [64, 7])
@pytest.mark.parametrize("B,T,H,Hkv,D,hp", ORACLE_CASES)
def test_matches_brute_force_oracle_fp64(B, T, H, Hkv, D, hp, chunk_rows, monkeypatch):
    # 7-row chunks split every case into many chunks, some half blind in the compressed branch.
    monkeypatch.setattr(chunked_attention, "CHUNK_ROWS", chunk_rows)
    inputs = make_inputs(B, T, H, Hkv, D, hp, seed=T * H + B)
    want, _ = brute_force_nsa(inputs, hp)
    got = run(inputs, hp)
    assert got.dtype == torch.float64 and got.shape == (B, T, H, D)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_branches_match_brute_force_branches():
    hp = hyper(8, 4, 16, 4, 20)
    inputs = make_inputs(1, 111, 6, 2, 3, hp, seed=4)
    _, branches = brute_force_nsa(inputs, hp)
    for index, name in enumerate(("cmp", "sel", "win")):
        torch.testing.assert_close(run(with_gates(inputs, index), hp), branches[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T,G", [(77, 3), (64, 1), (30, 20)])
def test_full_coverage_equals_dense_causal_attention(T, G):
    Ts = -(-T // 16)
    hp = hyper(8, 4, 16, Ts, T)  # n >= Ts selects every block; w >= T sees every earlier token
    inputs = make_inputs(2, T, 2 * G, 2, 5, hp, seed=T)
    sel = run(with_gates(inputs, 1), hp)
    torch.testing.assert_close(sel, dense_causal_attention(inputs["q"], inputs["k_sel"], inputs["v_sel"]),
                               rtol=1e-10, atol=1e-12)
    win = run(with_gates(inputs, 2), dict(hp, window_size=T + 5))
    torch.testing.assert_close(win, dense_causal_attention(inputs["q"], inputs["k_win"], inputs["v_win"]),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("branch", [0, 1, 2, None])
def test_causality_per_branch(branch):
    hp = hyper(8, 4, 16, 4, 12)
    T, t0 = 97, 52
    inputs = make_inputs(2, T, 4, 2, 4, hp, seed=9)
    if branch is not None:
        inputs = with_gates(inputs, branch)
    base = run(inputs, hp)
    changed = {k: v.clone() for k, v in inputs.items()}
    for name in ("q", "k_sel", "v_sel", "k_win", "v_win", "gates"):
        changed[name][:, t0 + 1 :] = torch.rand_like(changed[name][:, t0 + 1 :]) * 5 - 2
    first_unseen = (t0 - 8) // 4 + 1  # the first compressed block ending after t0
    for name in ("k_cmp", "v_cmp"):
        changed[name][:, first_unseen:] = torch.randn_like(changed[name][:, first_unseen:]) * 5
    after = run(changed, hp)
    assert torch.equal(after[:, : t0 + 1], base[:, : t0 + 1])
    assert not torch.allclose(after[:, t0 + 1 :], base[:, t0 + 1 :])


@pytest.mark.parametrize("B,T,H,Hkv,hp", [(1, 75, 4, 2, hyper(8, 4, 16, 3, 20)), (2, 41, 2, 2, hyper(4, 2, 4, 5, 6))])
def test_prefill_equals_token_by_token_decode(B, T, H, Hkv, hp):
    inputs = make_inputs(B, T, H, Hkv, 4, hp, seed=T)
    full = run(inputs, hp)
    for t in range(T):
        cache = prefix(inputs, hp, t + 1)
        step = {k: (v[:, t : t + 1] if k in ("q", "gates") else v) for k, v in cache.items()}
        one = nsa_attention_at(**step, q_start=t, **hp)
        torch.testing.assert_close(one[:, 0], full[:, t], rtol=1e-10, atol=1e-12, msg=f"t={t}")


def test_chunked_prefill_matches_full_rows():
    hp = hyper(8, 4, 16, 3, 20)
    inputs = make_inputs(1, 90, 4, 2, 4, hp, seed=1)
    full = run(inputs, hp)
    cache = prefix(inputs, hp, 70)
    part = nsa_attention_at(**{k: (v[:, 33:70] if k in ("q", "gates") else v) for k, v in cache.items()},
                            q_start=33, **hp)
    torch.testing.assert_close(part, full[:, 33:70], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(nsa_attention_at(**inputs, q_start=0, **hp), full, rtol=0, atol=0)


@pytest.mark.parametrize("T,H,Hkv,hp,chunk_rows", [
    (19, 2, 1, hyper(4, 2, 4, 4, 5), 64), (19, 2, 1, hyper(4, 2, 4, 4, 5), 4),
    (13, 4, 2, hyper(4, 2, 8, 3, 3), 5), (3, 2, 1, hyper(4, 2, 4, 2, 2), 64)])
def test_gradcheck_full_op(T, H, Hkv, hp, chunk_rows, monkeypatch):
    # Small chunks check that key/value gradients accumulate across chunks.
    monkeypatch.setattr(chunked_attention, "CHUNK_ROWS", chunk_rows)
    # Fixed seed, random inputs: no near-ties, so the eps-perturbations never change the selection.
    inputs = make_inputs(1, T, H, Hkv, 3, hp, seed=T, requires_grad=True)
    names = list(inputs)
    assert torch.autograd.gradcheck(lambda *xs: run(dict(zip(names, xs, strict=True)), hp), [inputs[n] for n in names])


@pytest.mark.parametrize("chunk_rows", [64, 4])
def test_gradcheck_branches_with_fixed_selection(chunk_rows, monkeypatch):
    monkeypatch.setattr(chunked_attention, "CHUNK_ROWS", chunk_rows)
    T, H, Hkv, D = 21, 4, 2, 3
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, k, v = rand(1, T, H, D), rand(1, T, Hkv, D), rand(1, T, Hkv, D)
    Tc = count_compressed_blocks(T, 4, 2)
    kc, vc = rand(1, Tc, Hkv, D), rand(1, Tc, Hkv, D)
    selection = torch.randint(0, 3, (1, T, Hkv, 2), generator=gen)
    selection = torch.minimum(selection, (torch.arange(T) // 4)[None, :, None, None])  # only valid blocks
    selection[..., 1] = -1  # exercise unused slots too
    torch.autograd.gradcheck(lambda a, b, c: selected_attention(a, b, c, selection, q_start=0, sel_block_size=4),
                             (q, k, v))
    torch.autograd.gradcheck(lambda a, b, c: window_attention(a, b, c, q_start=0, window_size=4), (q, k, v))
    torch.autograd.gradcheck(lambda a, b, c: compressed_attention(a, b, c, q_start=0, block_size=4, block_stride=2),
                             (q, kc, vc))


@pytest.mark.parametrize("T", [20, 5])
def test_blind_queries_get_zero_and_finite_gradients(T):
    hp = hyper(8, 4, 16, 3, 4)  # queries t < 7 see no compressed block; T = 5 has none at all
    inputs = with_gates(make_inputs(2, T, 4, 2, 4, hp, seed=2), 0)
    inputs = {k: v.requires_grad_() for k, v in inputs.items()}
    out = run(inputs, hp)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :7], torch.zeros_like(out[:, :7]))
    (out * torch.randn_like(out)).sum().backward()
    for name, x in inputs.items():
        assert torch.isfinite(x.grad).all(), name
    assert torch.equal(inputs["q"].grad[:, :7], torch.zeros_like(inputs["q"].grad[:, :7]))
    # Every branch blended: still finite everywhere.
    mixed = run(make_inputs(2, T, 4, 2, 4, hp, seed=3, requires_grad=True), hp)
    assert torch.isfinite(mixed).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_inputs(dtype, tol):
    hp = hyper(8, 4, 16, 4, 20)
    inputs = make_inputs(1, 70, 4, 2, 8, hp, seed=6)
    low = {k: v.to(dtype).requires_grad_() for k, v in inputs.items()}
    out = run(low, hp)
    assert out.dtype == dtype
    # The exact answer for the rounded inputs, from fp64 with the same selection.
    want = run({k: v.detach().double() for k, v in low.items()}, hp)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    out.float().sum().backward()
    assert all(x.grad.dtype == dtype and torch.isfinite(x.grad).all() for x in low.values())


def test_selection_used_by_the_op_is_select_blocks():
    # A selected-branch output built from select_blocks' blocks equals the op's selected branch.
    hp = hyper(8, 4, 16, 3, 20)
    inputs = make_inputs(1, 80, 4, 2, 4, hp, seed=12)
    sel = select_blocks(inputs["q"], inputs["k_cmp"], **{k: hp[k] for k in HYPER_NAMES[:4]})
    nested = [[[(row, None) for row in [[j for j in r if j >= 0] for r in g]] for g in b] for b in sel.tolist()]
    _, branches = brute_force_nsa(inputs, hp, selection=nested)
    torch.testing.assert_close(run(with_gates(inputs, 1), hp), branches["sel"], rtol=1e-10, atol=1e-12)


def test_backends_and_dispatch(monkeypatch):
    assert BACKENDS == ("reference", "triton")
    hp = hyper(8, 4, 16, 3, 20)
    inputs = make_inputs(1, 20, 2, 1, 4, hp)
    with pytest.raises(UserError, match="reference, triton"):
        run(inputs, hp, backend="flash")
    monkeypatch.setitem(sys.modules, "components.nsa.triton", None)  # import now fails
    with pytest.raises(UserError, match="triton"):
        run(inputs, hp, backend="triton")


@pytest.mark.parametrize(
    "change,field",
    [(dict(block_stride=3), "block_stride"), (dict(sel_block_size=18), "block_stride"),
     (dict(block_size=32), "sel_block_size"), (dict(num_selected=0), "num_selected"),
     (dict(window_size=0), "window_size"), (dict(block_size=8.0), "block_size")],
)
def test_invalid_hyperparameters_raise_user_error(change, field):
    hp = hyper(8, 4, 16, 3, 20)
    inputs = make_inputs(1, 40, 2, 1, 4, hp)
    with pytest.raises(UserError, match=field):
        run(inputs, dict(hp, **change))


def test_window_keys_may_start_at_the_first_querys_window():
    """window_start: k_win / v_win hold only the keys from that position on (a decode cache keeps the window's last
    keys alone): the same outputs, one query or a chunk, bit for bit; a start past a query's window is refused."""
    hp = hyper(8, 4, 16, 3, 20)
    inputs = make_inputs(1, 90, 4, 2, 4, hp, seed=2)
    cache = prefix(inputs, hp, 70)
    for q_start in (69, 33):
        queries = {k: v[:, q_start:70] for k, v in cache.items() if k in ("q", "gates")}
        whole = nsa_attention_at(**{**cache, **queries}, q_start=q_start, **hp)
        first = q_start - 20 + 1
        for start in (first, first - 5):
            recent = {k: v[:, start:] for k, v in cache.items() if k in ("k_win", "v_win")}
            got = nsa_attention_at(**{**cache, **queries, **recent}, q_start=q_start, window_start=start, **hp)
            assert torch.equal(got, whole)
    with pytest.raises(ValueError, match="window_start must be a Python int in 0..14"):
        nsa_attention_at(**{**cache, **queries, "k_win": cache["k_win"][:, 15:], "v_win": cache["v_win"][:, 15:]},
                         q_start=33, window_start=15, **hp)
    with pytest.raises(ValueError, match="k_win must be"):
        nsa_attention_at(**{**cache, **queries}, q_start=33, window_start=4, **hp)


def test_wrong_shapes_raise_value_error():
    hp = hyper(8, 4, 16, 3, 20)
    inputs = make_inputs(1, 40, 4, 2, 4, hp)
    bad = {
        "k_cmp": inputs["k_cmp"][:, :-1],
        "gates": inputs["gates"][..., :2],
        "v_win": inputs["v_win"][:, :-1],
        "k_sel": torch.randn(1, 40, 3, 4, dtype=torch.float64),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name if name != "k_sel" else "multiple"):
            run(dict(inputs, **{name: value}), hp)
    with pytest.raises(ValueError, match="q_start"):
        nsa_attention_at(**inputs, q_start=3, **hp)  # keys must number q_start + Tq
    with pytest.raises(ValueError, match="q_start"):
        nsa_attention_at(**inputs, q_start=-1, **hp)


class _RecordOps(TorchDispatchMode):
    """Records every op and the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.ops, self.largest = set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_no_host_sync_and_memory_bounded_by_chunks():
    hp = hyper(8, 4, 16, 4, 32)
    B, T, H = 1, 768, 2
    inputs = make_inputs(B, T, H, 1, 4, hp, dtype=torch.float32, requires_grad=True)
    with _RecordOps() as rec:
        out = run(inputs, hp)
        out.sum().backward()
    # .item(), bool(tensor), nonzero and masked_select all wait for the device.
    assert not rec.ops & {"_local_scalar_dense", "nonzero", "masked_select", "item"}, rec.ops
    # Score chunks are [B, H, 64, K <= T]: nothing close to a [B, H, T, T] matrix.
    assert rec.largest <= B * H * 64 * T, rec.largest
    assert rec.largest < B * H * T * T // 4


def test_decode_step_reads_only_what_its_branches_see():
    """One query at the end of a long cache (the decode step) copies no cache-sized tensor and builds no
    [Tc, Ts] overlap matrix (Tc * Ts grows with the square of the context), and gives the full forward's last row."""
    hp = hyper(8, 8, 16, 3, 24)
    B, T, H, Hkv, D = 2, 1000, 4, 2, 4
    inputs = make_inputs(B, T, H, Hkv, D, hp, dtype=torch.float32, seed=3)
    step = {k: (v[:, -1:] if k in ("q", "gates") else v) for k, v in inputs.items()}
    with _RecordOps() as rec:
        one = nsa_attention_at(**step, q_start=T - 1, **hp)
    # The Tc compressed keys, the n * l' selected tokens and the w window keys, each [B, Hkv, K, D] at most.
    Tc = inputs["k_cmp"].shape[1]
    assert rec.largest <= B * Hkv * D * max(Tc, 3 * 16, 24), rec.largest
    torch.testing.assert_close(one[:, 0], run(inputs, hp)[:, -1], rtol=1e-5, atol=1e-6)


def test_decode_step_gradients_match_the_reference():
    hp = hyper(4, 2, 8, 3, 6)
    inputs = make_inputs(2, 29, 4, 2, 4, hp, seed=5, requires_grad=True)
    step = {k: (v[:, -1:] if k in ("q", "gates") else v) for k, v in inputs.items()}
    weights = torch.randn(2, 1, 4, 4, dtype=torch.float64)
    tensors = list(step.values())
    want = torch.autograd.grad((nsa_attention_at_reference(**step, q_start=28, **hp) * weights).sum(), tensors)
    got = torch.autograd.grad((nsa_attention_at(**step, q_start=28, **hp) * weights).sum(), tensors)
    for name, g, w in zip(step, got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def test_no_is_causal_in_nsa_sources():
    for path in (REPO / "components" / "nsa").rglob("*.py"):
        assert "is_causal" not in path.read_text(), path
