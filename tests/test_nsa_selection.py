"""Block selection against a per-token brute force written from NSA_SPEC.md section 2."""

from __future__ import annotations

import pytest
import torch

from components.errors import UserError
from components.nsa import overlap_tokens, overlap_weights, select_blocks, select_blocks_at
from components.nsa.selection import spread_over_selection_blocks, top_blocks
from tests.test_nsa_bruteforce import (
    brute_force_selection,
    count_compressed_blocks,
    forced_priority,
    make_inputs,
    shared_tokens,
)

SMALL = dict(block_size=8, block_stride=4, sel_block_size=16, num_selected=3, window_size=1)


def _select(inputs, hyper, **extra):
    sel_hyper = {k: hyper[k] for k in ("block_size", "block_stride", "sel_block_size", "num_selected")}
    return select_blocks(inputs["q"], inputs["k_cmp"], **sel_hyper, **extra)


def _as_lists(selection):
    """[B, T, Hkv, n] tensor -> nested lists of chosen blocks (the -1 slots dropped)."""
    return [[[[j for j in row if j >= 0] for row in groups] for groups in rows] for rows in selection.tolist()]


def test_overlap_weights_paper_defaults_by_hand():
    # l=32, d=16, l'=64: selection block j=2 ([128, 192)) gets 1, 2, 2, 2, 1 from blocks 7 .. 11.
    w = overlap_weights(20, 5, 32, 16, 64)
    assert w.dtype == torch.float32
    assert w[:, 2].tolist() == [0] * 7 + [1, 2, 2, 2, 1] + [0] * 8
    assert w[:, 0].tolist()[:5] == [2, 2, 2, 1, 0]  # block 0 has no block -1 before it
    assert overlap_tokens(20, 5, 32, 16, 64)[:, 2].tolist() == [0] * 7 + [16, 32, 32, 32, 16] + [0] * 8


@pytest.mark.parametrize("l,d,lp", [(32, 16, 64), (8, 4, 16), (6, 3, 12), (4, 4, 8), (8, 2, 8), (6, 2, 18)])
def test_overlap_tokens_match_set_intersections(l, d, lp):
    Tc, Ts = 15, 6
    got = overlap_tokens(Tc, Ts, l, d, lp)
    want = [[shared_tokens(i, j, l, d, lp) for j in range(Ts)] for i in range(Tc)]
    assert got.tolist() == want
    assert (overlap_weights(Tc, Ts, l, d, lp) * d).tolist() == want


@pytest.mark.parametrize("l,d,lp", [(32, 16, 64), (8, 4, 16), (6, 3, 12), (4, 4, 8), (8, 2, 8), (6, 2, 18)])
def test_spread_over_selection_blocks_is_the_overlap_product(l, d, lp):
    # Every length from none to four whole selection blocks: Tc = 0, blocks cut at either end.
    for T in range(1, 4 * lp + 1):
        Tc, Ts = count_compressed_blocks(T, l, d), -(-T // lp)
        p = torch.rand(2, 3, Tc, dtype=torch.float64)
        want = p @ overlap_weights(Tc, Ts, l, d, lp, dtype=torch.float64)
        torch.testing.assert_close(spread_over_selection_blocks(p, Ts, l, d, lp), want, rtol=1e-14, atol=0)


def _assert_same_or_tied(got, want_with_scores, tol):
    """Equal sets; where they differ (fp32 only), the swapped blocks' scores must tie within tol."""
    for b, rows in enumerate(want_with_scores):
        for t, groups in enumerate(rows):
            for g, (want, scores) in enumerate(groups):
                have = got[b][t][g]
                assert have == sorted(have) and len(set(have)) == len(have)
                if have == want:
                    continue
                extra, missing = set(have) - set(want), set(want) - set(have)
                assert len(extra) == len(missing), (b, t, g, have, want)
                assert max(scores[j] for j in missing) - min(scores[j] for j in extra) <= tol, (b, t, g, have, want)


@pytest.mark.parametrize(
    "B,T,H,Hkv,hyper",
    [
        (2, 63, 2, 1, SMALL),
        (1, 111, 6, 1, dict(SMALL, num_selected=4)),
        (1, 70, 4, 2, dict(block_size=6, block_stride=3, sel_block_size=12, num_selected=2, window_size=1)),
        (1, 50, 20, 1, dict(block_size=4, block_stride=2, sel_block_size=8, num_selected=5, window_size=1)),
        (1, 45, 2, 2, dict(block_size=8, block_stride=8, sel_block_size=8, num_selected=1, window_size=1)),
        (2, 130, 4, 2, dict(block_size=4, block_stride=2, sel_block_size=8, num_selected=6, window_size=1)),
    ],
)
def test_selection_matches_brute_force_fp64(B, T, H, Hkv, hyper):
    inputs = make_inputs(B, T, H, Hkv, 5, hyper, seed=T + H)
    got = _select(inputs, hyper)
    assert got.dtype == torch.long and got.shape == (B, T, Hkv, hyper["num_selected"])
    want = brute_force_selection(inputs["q"], inputs["k_cmp"], hyper)
    assert _as_lists(got) == [[[row for row, _ in groups] for groups in rows] for rows in want]


def test_selection_matches_brute_force_fp32_and_bf16():
    hyper = dict(SMALL, num_selected=4)
    inputs = make_inputs(1, 97, 4, 2, 8, hyper, seed=3)
    want = brute_force_selection(inputs["q"], inputs["k_cmp"], hyper)
    for dtype in (torch.float32, torch.bfloat16):
        cast = {k: v.to(dtype) for k, v in inputs.items()}
        # bf16 inputs are rounded; the oracle must see the same rounded values.
        want_cast = want if dtype == torch.float32 else brute_force_selection(cast["q"], cast["k_cmp"], hyper)
        _assert_same_or_tied(_as_lists(_select(cast, hyper)), want_cast, tol=1e-5)


def test_output_format_ascending_with_trailing_minus_one():
    hyper = dict(SMALL, num_selected=5)
    T = 77  # 5 selection blocks, the last one partial
    sel = _select(make_inputs(2, T, 4, 2, 4, hyper, seed=1), hyper)
    for t in range(T):
        valid = t // 16 + 1
        rows = sel[:, t].reshape(-1, 5)
        used = rows[:, : min(valid, 5)]
        assert (rows[:, min(valid, 5):] == -1).all()
        assert (used >= 0).all() and (used <= t // 16).all()
        assert (used[:, 1:] > used[:, :-1]).all()


def test_forced_blocks_always_present():
    hyper = dict(block_size=4, block_stride=2, sel_block_size=8, num_selected=3, window_size=1)
    inputs = make_inputs(2, 90, 6, 3, 4, hyper, seed=5)
    # Make some far block overwhelmingly important so that the forced ones would lose on score.
    inputs["k_cmp"][:, 20] = 50 * inputs["q"].mean(dim=(1, 2))[:, None, :]
    sel = _select(inputs, hyper)
    for t in range(90):
        current = t // 8
        for block in {0, current, max(current - 1, 0)}:
            assert (sel[:, t] == block).any(dim=-1).all(), (t, block)


@pytest.mark.parametrize("n", [4, 6])
def test_ties_go_to_the_smaller_block(n):
    # One-hot compressed attention: every query puts probability exactly 1 on compressed block 5,
    # which covers tokens [10, 14) and shares 2 tokens with each of selection blocks 2 ([8, 12))
    # and 3 ([12, 16)). So blocks 2 and 3 tie exactly (score G * 1 = 2), every other block ties
    # at exactly 0, and the free slots must go to the smaller indices.
    T, D = 40, 4
    Tc = count_compressed_blocks(T, 4, 2)
    q = torch.zeros(1, T, 2, D, dtype=torch.float64)
    q[..., 0] = 1.0
    k_cmp = torch.zeros(1, Tc, 1, D, dtype=torch.float64)
    k_cmp[0, 5, 0, 0] = 2000.0  # logit 1000 against 0: exp(-1000) is exactly 0 in fp32 and fp64
    sel = select_blocks(q, k_cmp, block_size=4, block_stride=2, sel_block_size=4, num_selected=n)
    for t in range(13, T):  # block 5 is visible from t = 13
        current = t // 4
        forced = {0, current - 1, current}
        score = {j: (2.0 if j in (2, 3) else 0.0) for j in range(current + 1)}
        rest = sorted((j for j in score if j not in forced), key=lambda j: (-score[j], j))
        want = sorted(forced | set(rest[: n - len(forced)]))
        assert sel[0, t, 0].tolist() == want + [-1] * (n - len(want)), t
    # The same with float32 inputs, which take the other ranking path.
    sel32 = select_blocks(q.float(), k_cmp.float(), block_size=4, block_stride=2, sel_block_size=4, num_selected=n)
    assert torch.equal(sel32, sel)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_top_blocks_ties_on_integer_scores_match_python_sort(n):
    """n = 1 and 2 keep fewer blocks than are forced: the current block, then block 0, then the previous."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        scores = torch.randint(0, 3, (2, 50, 3, 7), generator=gen).to(dtype)  # many exact ties
        got = top_blocks(scores, q_start=0, sel_block_size=8, num_selected=n).tolist()
        for b in range(2):
            for t in range(50):
                for g in range(3):
                    current = t // 8
                    row = scores[b, t, g].tolist()
                    ranked = sorted(range(current + 1), key=lambda j: (forced_priority(j, current), -row[j], j))
                    want = sorted(ranked[:n]) + [-1] * (n - min(n, current + 1))
                    assert got[b][t][g] == want, (dtype, n, b, t, g)
                    if n == 1:
                        assert want == [current]


def test_fewer_valid_blocks_than_n_selects_all():
    hyper = dict(SMALL, num_selected=16)
    sel = _select(make_inputs(1, 60, 2, 1, 4, hyper), hyper)  # at most 4 valid blocks
    for t in range(60):
        want = list(range(t // 16 + 1))
        assert sel[0, t, 0].tolist() == want + [-1] * (16 - len(want))


def test_no_compressed_block_selects_block_zero():
    hyper = SMALL
    inputs = make_inputs(2, 7, 2, 1, 4, hyper)  # T < l: Tc = 0
    assert inputs["k_cmp"].shape[1] == 0
    sel = _select(inputs, hyper)
    assert sel[..., 0].eq(0).all() and sel[..., 1:].eq(-1).all()


def test_selection_is_causal():
    hyper = dict(SMALL, num_selected=4)
    T, t0 = 100, 57
    inputs = make_inputs(2, T, 4, 2, 6, hyper, seed=11)
    base = _select(inputs, hyper)
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["q"][:, t0 + 1 :] = torch.randn_like(changed["q"][:, t0 + 1 :]) * 3
    first_unseen = (t0 - 8) // 4 + 1  # compressed blocks ending after t0
    changed["k_cmp"][:, first_unseen:] = torch.randn_like(changed["k_cmp"][:, first_unseen:]) * 3
    after = _select(changed, hyper)
    assert torch.equal(after[:, : t0 + 1], base[:, : t0 + 1])
    assert not torch.equal(after[:, t0 + 1 :], base[:, t0 + 1 :])


def test_select_blocks_at_matches_full_selection_row_by_row():
    hyper = dict(SMALL, num_selected=3)
    T = 83
    inputs = make_inputs(1, T, 6, 2, 4, hyper, seed=2)
    full = _select(inputs, hyper)
    sel_hyper = {k: hyper[k] for k in ("block_size", "block_stride", "sel_block_size", "num_selected")}
    for t in range(T):
        Tc = count_compressed_blocks(t + 1, 8, 4)
        one = select_blocks_at(inputs["q"][:, t : t + 1], inputs["k_cmp"][:, :Tc], q_start=t, **sel_hyper)
        assert torch.equal(one[:, 0], full[:, t]), t
    # A middle slice of several queries at once.
    Tc = count_compressed_blocks(60, 8, 4)
    part = select_blocks_at(inputs["q"][:, 31:60], inputs["k_cmp"][:, :Tc], q_start=31, **sel_hyper)
    assert torch.equal(part, full[:, 31:60])


def test_selection_carries_no_gradient():
    hyper = SMALL
    inputs = make_inputs(1, 40, 2, 1, 4, hyper, requires_grad=True)
    sel = _select(inputs, hyper)
    assert not sel.requires_grad and sel.grad_fn is None


@pytest.mark.parametrize(
    "change",
    [dict(block_stride=3), dict(sel_block_size=18), dict(block_size=32), dict(num_selected=0),
     dict(block_stride=0), dict(num_selected=2.5)],
)
def test_invalid_hyperparameters_raise_user_error(change):
    hyper = dict(SMALL, **change)
    inputs = make_inputs(1, 40, 2, 1, 4, SMALL)
    with pytest.raises(UserError):
        _select(inputs, hyper)


def test_wrong_shapes_raise_value_error():
    inputs = make_inputs(1, 40, 2, 1, 4, SMALL)
    with pytest.raises(ValueError, match="k_cmp"):
        _select(dict(inputs, k_cmp=inputs["k_cmp"][:, :-1]), SMALL)
    with pytest.raises(ValueError, match="multiple"):
        _select(dict(inputs, q=torch.randn(1, 40, 3, 4, dtype=torch.float64),
                     k_cmp=torch.randn(1, inputs["k_cmp"].shape[1], 2, 4, dtype=torch.float64)), SMALL)
