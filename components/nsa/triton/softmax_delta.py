"""delta[b, h, t] = sum_d dO[b, t, h, d] * O[b, t, h, d] in fp32: the backward's row correction.

A kernel rather than (do.float() * o.float()).sum(-1), which would allocate two fp32 copies of
a [B, T, H, D] tensor per branch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.nsa.triton.launch import flat_grid
from components.nsa.triton.tile_configs import cdiv, head_block
from components.nsa.triton.tiles import grid_position


@triton.jit
def _softmax_delta_kernel(
    DO, O, DELTA, sdob, sdot, sdoh, sob, sot, soh, T, H,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid_t, pid_bh = grid_position(tl.cdiv(T, BLOCK_T))
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    rows = offs_t.to(tl.int64)[:, None]
    do = tl.load(DO + b * sdob + h * sdoh + rows * sdot + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + b * sob + h * soh + rows * sot + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + (b * H + h) * T + offs_t, tl.sum(do * o, 1), mask=offs_t < T)


def softmax_delta(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] x2 (last dim dense) -> delta [B, H, T] fp32."""
    B, T, H, D = o.shape
    delta = torch.empty(B, H, T, device=o.device, dtype=torch.float32)
    if delta.numel() == 0:
        return delta
    block_t = min(128, 4096 // head_block(D))  # about 32 values per thread per operand
    _softmax_delta_kernel[flat_grid(cdiv(T, block_t), B * H)](
        do, o, delta, do.stride(0), do.stride(1), do.stride(2), o.stride(0), o.stride(1), o.stride(2), T, H,
        D=D, BLOCK_D=head_block(D), BLOCK_T=block_t, num_warps=4,
    )
    return delta
