"""Training FLOPs per token, counting what NSA really computes (for MFU).

    flops_per_token = 6 * N_mm + 6 * C_phi + A

N_mm   weights each token meets in a matmul once: per layer the attention projections (q, the
       K/V projections, the output projection, the gate layers) and the SwiGLU (3 * dim * hidden),
       plus the output head (dim * vocab). The embedding lookup is no matmul; norms, biases,
       RoPE and softmax are left out as small. 6 = 2 (multiply-add) * 3 (forward + backward).
C_phi  NSA compression: phi runs once per compressed block, per kv head, for keys and for
       values: C_phi = n_layers * 2 * Hkv * W_phi * Tc(T) / T, W_phi = phi's matmul weights.
A      attention products, per layer: each (query, key) pair costs 2*D for q.k and 2*D for p.v
       per head, so 12 * H * D * K for training, K the keys a query attends, averaged over the
       positions t = 0 .. T-1 of the sequence:
         dense  K = (T + 1) / 2                       (causal)
         NSA    K = K_cmp + K_sel + K_win with
                K_cmp(t) = Tc(t + 1)                   compressed blocks visible at t
                K_sel(t) = t + 1                       when all t//l' + 1 valid blocks fit in n
                         = (n - 1) * l' + t%l' + 1    otherwise: n - 1 full blocks and the current
                                                       one up to t (the current block is forced
                                                       first, so this holds for n = 1 and 2 too)
                K_win(t) = min(w, t + 1)
       NSA also scores blocks for selection: q . k_cmp over the visible compressed blocks once more,
       forward only (selection is discrete, no gradient): + 2 * H * D * K_cmp per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from components.models.args import TransformerArgs
from components.models.transformer import TransformerBlock
from components.nsa.compression import KVCompressor, num_compressed_blocks


def _matmul_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def _block_weights(args: TransformerArgs) -> tuple[int, int]:
    """(matmul weights of one block outside phi, matmul weights of one phi), counted on a meta-device block."""
    with torch.device("meta"):
        block = TransformerBlock(args)
    phi = [m for m in block.modules() if isinstance(m, KVCompressor)]
    phi_weights = sum(_matmul_weights(m) for m in phi)
    per_phi = _matmul_weights(phi[0]) if phi else 0
    return _matmul_weights(block) - phi_weights, per_phi


def visible_keys(nsa, seq_len: int) -> dict[str, torch.Tensor]:
    """Keys the query at position t sees in each NSA branch, t = 0..seq_len-1: int64 [seq_len] by branch
    ('cmp', 'sel', 'win'; see the module docstring). `nsa` holds the hyperparameters by their NSA names
    (block_size, block_stride, sel_block_size, num_selected, window_size)."""
    t = torch.arange(seq_len, dtype=torch.int64)
    l, d, ls, n, w = nsa.block_size, nsa.block_stride, nsa.sel_block_size, nsa.num_selected, nsa.window_size
    cmp = torch.where(t + 1 >= l, (t + 1 - l) // d + 1, torch.zeros_like(t))
    current = t // ls
    partial = (n - 1) * ls + t % ls + 1
    sel = torch.where(current + 1 <= n, t + 1, partial)
    win = torch.clamp(t + 1, max=w)
    return {"cmp": cmp, "sel": sel, "win": win}


def average_keys(args: TransformerArgs, seq_len: int) -> dict[str, float]:
    """Mean keys per query over positions 0..seq_len-1, by branch ('dense' or 'cmp', 'sel', 'win')."""
    if args.attention == "dense":
        return {"dense": (seq_len + 1) / 2}
    return {name: int(k.sum()) / seq_len for name, k in visible_keys(args.nsa, seq_len).items()}


def flops_per_token(args: TransformerArgs, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token at sequence length seq_len (see the module docstring)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    H, Hkv, D, L = args.n_heads, args.n_kv_heads, args.head_dim, args.n_layers
    block, per_phi = _block_weights(args)
    flops = 6.0 * (L * block + args.dim * vocab_size)
    keys = average_keys(args, seq_len)
    flops += L * 12.0 * H * D * sum(keys.values())
    if args.attention == "nsa":
        tc = num_compressed_blocks(seq_len, args.nsa.block_size, args.nsa.block_stride)
        flops += 6.0 * L * 2 * Hkv * per_phi * tc / seq_len
        flops += L * 2.0 * H * D * keys["cmp"]
    return flops
