"""Brute-force NSA oracles written from NSA_SPEC.md with plain per-token loops, and their own checks.

Nothing here imports the implementation's math: overlaps come from Python sets of token
positions, softmaxes are taken one query at a time over explicit lists of visible keys.
"""

from __future__ import annotations

import math

import torch

HYPER_NAMES = ("block_size", "block_stride", "sel_block_size", "num_selected", "window_size")


def count_compressed_blocks(T: int, l: int, d: int) -> int:
    """Complete blocks [i*d, i*d + l) inside [0, T), counted one by one."""
    count = 0
    while count * d + l <= T:
        count += 1
    return count


def make_inputs(B, T, H, Hkv, D, hyper, dtype=torch.float64, seed=0, requires_grad=False):
    """The op's eight tensors with random values (gates in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    Tc = count_compressed_blocks(T, hyper["block_size"], hyper["block_stride"])

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    return dict(
        q=rand(B, T, H, D),
        k_cmp=rand(B, Tc, Hkv, D), v_cmp=rand(B, Tc, Hkv, D),
        k_sel=rand(B, T, Hkv, D), v_sel=rand(B, T, Hkv, D),
        k_win=rand(B, T, Hkv, D), v_win=rand(B, T, Hkv, D),
        gates=torch.rand(B, T, H, 3, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad),
    )


def _softmax_attend(q_vec, keys, values):
    """softmax(q . k / sqrt(D)) v over an explicit list of key rows (fp64)."""
    D = q_vec.shape[-1]
    logits = torch.stack([torch.dot(q_vec, k) for k in keys]) / math.sqrt(D)
    p = torch.softmax(logits, dim=0)
    return sum(p[i] * values[i] for i in range(len(values)))


def compressed_probabilities(q_vec, k_cmp_rows, t, l, d):
    """{block i: p_cmp[t, i]} over the blocks query t sees (empty dict when none)."""
    visible = [i for i in range(len(k_cmp_rows)) if i * d + l - 1 <= t]
    if not visible:
        return {}
    D = q_vec.shape[-1]
    logits = torch.tensor([float(torch.dot(q_vec, k_cmp_rows[i])) / math.sqrt(D) for i in visible], dtype=torch.float64)
    p = torch.softmax(logits, dim=0)
    return {i: float(p[n]) for n, i in enumerate(visible)}


def shared_tokens(i, j, l, d, lp):
    """ov(i, j): tokens in both compression block i and selection block j, by set intersection."""
    return len(set(range(i * d, i * d + l)) & set(range(j * lp, (j + 1) * lp)))


def brute_force_group_scores(q, k_cmp, b, t, g, hyper):
    """{j: s[t, g, j]} for the valid blocks j <= t // l' of query t in group g (spec section 2)."""
    l, d, lp = hyper["block_size"], hyper["block_stride"], hyper["sel_block_size"]
    H, Hkv = q.shape[2], k_cmp.shape[2]
    G = H // Hkv
    scores = {j: 0.0 for j in range(t // lp + 1)}
    for h in range(g * G, (g + 1) * G):
        p = compressed_probabilities(q[b, t, h].double(), k_cmp[b, :, g].double(), t, l, d)
        for j in scores:
            scores[j] += sum(shared_tokens(i, j, l, d, lp) * pi for i, pi in p.items())
    return scores


def brute_force_selection_row(scores, t, lp, n):
    """Chosen blocks for query t from {j: score}: forced first (the current block, then block 0, then
    the previous one), then by score, ties to the smaller j; returns the ascending list."""
    ranked = sorted(scores, key=lambda j: (forced_priority(j, t // lp), -scores[j], j))
    return sorted(ranked[:n])


def forced_priority(j, current):
    """0, 1, 2 for the current block, block 0 and the previous block; 3 for every other block."""
    return 0 if j == current else 1 if j == 0 else 2 if j == current - 1 else 3


def brute_force_selection(q, k_cmp, hyper):
    """[B][T][Hkv] -> (ascending list of chosen blocks, {j: score})."""
    B, T = q.shape[:2]
    Hkv = k_cmp.shape[2]
    lp, n = hyper["sel_block_size"], hyper["num_selected"]
    out = []
    for b in range(B):
        rows = []
        for t in range(T):
            groups = []
            for g in range(Hkv):
                scores = brute_force_group_scores(q, k_cmp, b, t, g, hyper)
                groups.append((brute_force_selection_row(scores, t, lp, n), scores))
            rows.append(groups)
        out.append(rows)
    return out


def brute_force_nsa(inputs, hyper, selection=None):
    """The whole op, one (b, t, h) at a time, in fp64. Returns (o, per-branch outputs)."""
    q, k_cmp, v_cmp = (inputs[x].detach().double() for x in ("q", "k_cmp", "v_cmp"))
    k_sel, v_sel, k_win, v_win = (inputs[x].detach().double() for x in ("k_sel", "v_sel", "k_win", "v_win"))
    gates = inputs["gates"].detach().double()
    l, d, lp, w = hyper["block_size"], hyper["block_stride"], hyper["sel_block_size"], hyper["window_size"]
    B, T, H, D = q.shape
    Hkv = k_sel.shape[2]
    G = H // Hkv
    if selection is None:
        selection = brute_force_selection(q, k_cmp, hyper)
    branches = {name: torch.zeros(B, T, H, D, dtype=torch.float64) for name in ("cmp", "sel", "win")}
    for b in range(B):
        for t in range(T):
            for h in range(H):
                g = h // G
                qv = q[b, t, h]
                visible = [i for i in range(k_cmp.shape[1]) if i * d + l - 1 <= t]
                if visible:
                    branches["cmp"][b, t, h] = _softmax_attend(qv, [k_cmp[b, i, g] for i in visible],
                                                               [v_cmp[b, i, g] for i in visible])
                chosen = selection[b][t][g][0]
                tokens = [s for j in chosen for s in range(j * lp, (j + 1) * lp) if s <= t]
                branches["sel"][b, t, h] = _softmax_attend(qv, [k_sel[b, s, g] for s in tokens],
                                                           [v_sel[b, s, g] for s in tokens])
                window = list(range(max(0, t - w + 1), t + 1))
                branches["win"][b, t, h] = _softmax_attend(qv, [k_win[b, s, g] for s in window],
                                                           [v_win[b, s, g] for s in window])
    o = gates[..., 0:1] * branches["cmp"] + gates[..., 1:2] * branches["sel"] + gates[..., 2:3] * branches["win"]
    return o, branches


def dense_causal_attention(q, k, v):
    """Plain causal attention with an explicit lower-triangular mask; K/V heads shared by h // G."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    k = k.repeat_interleave(G, dim=2)
    v = v.repeat_interleave(G, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs, v)


# The oracle's own checks, on cases small enough to know by hand.

def test_count_compressed_blocks_by_hand():
    assert count_compressed_blocks(31, 32, 16) == 0
    assert count_compressed_blocks(32, 32, 16) == 1
    assert count_compressed_blocks(47, 32, 16) == 1
    assert count_compressed_blocks(48, 32, 16) == 2
    assert count_compressed_blocks(111, 8, 4) == 26


def test_shared_tokens_by_hand():
    # l=32, d=16, l'=64: block i=3 covers [48, 80), selection block 1 covers [64, 128).
    assert shared_tokens(3, 1, 32, 16, 64) == 16
    assert shared_tokens(4, 1, 32, 16, 64) == 32
    assert shared_tokens(2, 1, 32, 16, 64) == 0


def test_brute_force_selection_row_rules():
    # Query 200 with l'=64: current block 3, previous 2, block 0 forced; then by score, ties to smaller j.
    scores = {0: 0.0, 1: 5.0, 2: 0.0, 3: 0.0}
    assert brute_force_selection_row(scores, 200, 64, 3) == [0, 2, 3]
    assert brute_force_selection_row(scores, 200, 64, 4) == [0, 1, 2, 3]
    scores = {0: 0.0, 1: 2.0, 2: 2.0, 3: 2.0, 4: 0.0, 5: 0.0}
    assert brute_force_selection_row(scores, 330, 64, 4) == [0, 1, 4, 5]


def test_dense_causal_attention_first_row_is_first_value():
    q, k, v = (torch.randn(1, 5, 2, 3, dtype=torch.float64) for _ in range(3))
    out = dense_causal_attention(q, k, v)
    torch.testing.assert_close(out[:, 0], v[:, 0], rtol=0, atol=1e-15)
