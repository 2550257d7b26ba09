"""flops_per_token against hand counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.models import NSAArgs, TransformerArgs, flops_per_token
from components.models.flops import average_keys
from components.nsa import KVCompressor, num_compressed_blocks, select_blocks

# dim 8, one layer, H 2, Hkv 1 (D 4), SwiGLU hidden round_up(int(2/3*3*8) = 16, 4) = 16, vocab 10, T 10
BASE = dict(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, mlp_ratio=3.0, multiple_of=4, max_seq_len=16)
NSA = NSAArgs(block_size=4, block_stride=2, sel_block_size=4, num_selected=2, window_size=3,
              compress="mean", gate="linear", kv_per_branch=True)


def test_dense_hand_count():
    args = TransformerArgs(**BASE, attention="dense")
    # weights: q 8*8 + k 8*4 + v 8*4 + o 8*8 + SwiGLU 3*8*16 = 576; head 8*10 = 80
    params = 6 * (576 + 80)  # 3936
    # causal: average (T+1)/2 = 5.5 keys; 12 * H * D = 96 per key
    attention = 96 * 5.5  # 528
    assert flops_per_token(args, 10, 10) == pytest.approx(params + attention) == 4464


def test_nsa_hand_count():
    nsa = dataclasses.replace(NSA, block_size=2, block_stride=1, sel_block_size=2, num_selected=3)
    args = TransformerArgs(**BASE, attention="nsa", nsa=nsa)
    # weights: q 64 + six K/V 6*8*4 = 192 + o 64 + gate 8*(3*2) = 48 + SwiGLU 384 = 752; head 80
    params = 6 * (752 + 80)  # 4992
    # per position t = 0..9 (l 2, d 1, l' 2, n 3, w 3):
    cmp = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # blocks i with i + 1 <= t
    sel = [1, 2, 3, 4, 5, 6, 5, 6, 5, 6]  # t >= 6: two full blocks + (t%2 + 1) of the current one
    win = [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    assert average_keys(args, 10) == pytest.approx({"cmp": 4.5, "sel": 4.3, "win": 2.7})
    attention = 96 * (sum(cmp) + sum(sel) + sum(win)) / 10  # 12 * H * D = 96 per key: 1104
    scoring = 2 * 2 * 4 * sum(cmp) / 10  # forward-only q.k_cmp: 72
    assert flops_per_token(args, 10, 10) == pytest.approx(params + attention + scoring) == pytest.approx(6168)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_average_keys_match_what_the_op_attends(n):
    """K_cmp and K_sel against the blocks the op really selects (random scores)."""
    l, d, ls, T = 4, 2, 4, 27
    nsa = NSAArgs(block_size=l, block_stride=d, sel_block_size=ls, num_selected=n, window_size=5)
    q = torch.randn(1, T, 2, 4)
    k_cmp = torch.randn(1, num_compressed_blocks(T, l, d), 1, 4)
    chosen = select_blocks(q, k_cmp, block_size=l, block_stride=d, sel_block_size=ls, num_selected=n)
    sel = cmp = 0
    for t in range(T):
        blocks = [j for j in chosen[0, t, 0].tolist() if j >= 0]
        sel += sum(1 for s in range(t + 1) if s // ls in blocks)
        cmp += sum(1 for i in range(k_cmp.shape[1]) if i * d + l - 1 <= t)
    keys = average_keys(TransformerArgs(**BASE, attention="nsa", nsa=nsa), T)
    assert keys["sel"] == pytest.approx(sel / T) and keys["cmp"] == pytest.approx(cmp / T)


def test_nsa_compression_and_gate_mlp_terms():
    mean = TransformerArgs(**BASE, attention="nsa", nsa=NSA)
    mlp = dataclasses.replace(mean, nsa=dataclasses.replace(NSA, compress="mlp", gate="mlp"))
    phi = KVCompressor("mlp", 4, 2, 4)
    phi_weights = sum(m.weight.numel() for m in phi.modules() if isinstance(m, torch.nn.Linear))
    # phi runs per compressed block (Tc = 4 at T = 10), per kv head, for k and v
    compression = 6 * 2 * 1 * phi_weights * 4 / 10
    # gate MLP: 8 -> 2 (dim/4) -> 6 replaces the 8 -> 6 linear gate
    gate_delta = 6 * (8 * 2 + 2 * 6 - 8 * 6)
    assert flops_per_token(mlp, 10, 10) - flops_per_token(mean, 10, 10) == pytest.approx(compression + gate_delta)


def test_full_coverage_matches_dense_keys():
    # with n >= Ts and w >= T, the sel and win branches each see the causal prefix
    nsa = dataclasses.replace(NSA, num_selected=8, window_size=64)
    keys = average_keys(TransformerArgs(**BASE, attention="nsa", nsa=nsa), 29)
    dense = average_keys(TransformerArgs(**BASE, attention="dense"), 29)["dense"]
    assert keys["sel"] == pytest.approx(dense) and keys["win"] == pytest.approx(dense) == 15.0


def test_nsa_is_cheaper_than_dense_at_long_context():
    nsa, dense = TransformerArgs(), TransformerArgs(attention="dense")
    assert flops_per_token(nsa, 50000, 32768) < 0.5 * flops_per_token(dense, 50000, 32768)
