"""The gated sum of the three branches and its backward, each one pass over the rows (b, t, h).

    o = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win          (fp32, stored in the branches' dtype)
    d_o_b = g_b * dO,  d_g_b = sum_d dO * o_b                  (fp32 sums, stored in each input's dtype)

The same fp32 arithmetic as gating with torch ops, in one kernel each way instead of a chain of
elementwise ops that each read and write a whole [B, T, H, D] tensor (and whose autograd keeps fp32
copies of the three branch outputs for the backward). Rows of a [B, T, H, D] tensor are dense: the
custom ops (ops.py) pass contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.nsa.triton.tile_configs import cdiv, head_block


@triton.jit
def _row_tile(pid, R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """(rows [BLOCK_R] int64, row mask, offsets into a dense [R, D] tensor, tile mask) of program pid."""
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < R
    return rows, r_ok, rows[:, None] * D + offs_d[None, :], r_ok[:, None] & (offs_d < D)[None, :]


@triton.jit
def _gate_fwd_kernel(OC, OS, OW, G, O, R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, r_ok, offs, mask = _row_tile(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    g_cmp = tl.load(G + rows * 3, mask=r_ok, other=0.0).to(tl.float32)
    g_sel = tl.load(G + rows * 3 + 1, mask=r_ok, other=0.0).to(tl.float32)
    g_win = tl.load(G + rows * 3 + 2, mask=r_ok, other=0.0).to(tl.float32)
    o = g_cmp[:, None] * tl.load(OC + offs, mask=mask, other=0.0).to(tl.float32)
    o += g_sel[:, None] * tl.load(OS + offs, mask=mask, other=0.0).to(tl.float32)
    o += g_win[:, None] * tl.load(OW + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + offs, o.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_kernel(DO, OC, OS, OW, G, DOC, DOS, DOW, DG, R, D: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    rows, r_ok, offs, mask = _row_tile(tl.program_id(0), R, D, BLOCK_R, BLOCK_D)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    _branch_grads(do, OC, DOC, G, DG, 0, rows, r_ok, offs, mask)
    _branch_grads(do, OS, DOS, G, DG, 1, rows, r_ok, offs, mask)
    _branch_grads(do, OW, DOW, G, DG, 2, rows, r_ok, offs, mask)


@triton.jit
def _branch_grads(do, O_B, DO_B, G, DG, branch: tl.constexpr, rows, r_ok, offs, mask):
    """Branch `branch`'s share of dO (g_b * dO) and its gate's gradient (sum_d dO * o_b) for a tile."""
    g = tl.load(G + rows * 3 + branch, mask=r_ok, other=0.0).to(tl.float32)
    tl.store(DO_B + offs, (g[:, None] * do).to(DO_B.dtype.element_ty), mask=mask)
    o_b = tl.load(O_B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DG + rows * 3 + branch, tl.sum(do * o_b, 1).to(DG.dtype.element_ty), mask=r_ok)


def _launch(x: torch.Tensor) -> tuple[tuple[int], int, dict]:
    """(grid, rows, tile sizes) over the rows of x [..., D]: about 4096 values of each tensor per program."""
    D = x.shape[-1]
    rows = x.numel() // D
    block_d = head_block(D)
    block_r = max(1, 4096 // block_d)
    return (cdiv(rows, block_r),), rows, dict(D=D, BLOCK_R=block_r, BLOCK_D=block_d)


def gate_fwd(o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """o [B, T, H, D] in o_cmp's dtype from three contiguous branch outputs and contiguous gates [B, T, H, 3]."""
    o = torch.empty_like(o_cmp)
    if o.numel():
        grid, rows, tiles = _launch(o)
        _gate_fwd_kernel[grid](o_cmp, o_sel, o_win, gates, o, rows, **tiles, num_warps=4)
    return o


def gate_bwd(do: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor,
             gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_o_cmp, d_o_sel, d_o_win, d_gates), each in its input's dtype; every tensor contiguous."""
    grads = [torch.empty_like(x) for x in (o_cmp, o_sel, o_win, gates)]
    if do.numel():
        grid, rows, tiles = _launch(do)
        _gate_bwd_kernel[grid](do, o_cmp, o_sel, o_win, gates, *grads, rows, **tiles, num_warps=4)
    else:
        for g in grads:
            g.zero_()
    return tuple(grads)
