"""Does an NSA backend compute NSA on this device? Three short numerical checks.

On a small random problem with the recipe's hyperparameters (block sizes, n, w) and head shape:
1. causality: changing every input after position t changes no output at positions <= t, and
   does change later outputs (so the perturbation was real);
2. full coverage against plain attention written here: with n >= Ts and only the selected branch
   gated on, and with w >= T and only the window branch gated on, NSA is dense causal attention;
3. parity with the reference backend, outputs and gradients (only when the backend is not the
   reference itself), in fp32 on one row and, with `documents`, on a row of packed documents.
Those run in fp32, so their tolerances are those of fp32 arithmetic. With `low_precision` (the dtype
training computes in, bf16 on a GPU) a last check runs the backend in that dtype with the model's
whole head group (so the kernels' own tile shapes and layout for it run) against the fp32 reference
on the same rounded inputs, to a relative RMS error of LOW_PRECISION_RMS.
"""

from __future__ import annotations

import math

import torch

from components.nsa.compression import num_compressed_blocks
from components.nsa.hyperparams import num_selection_blocks
from components.nsa.op import nsa_attention

ATOL = RTOL = 5e-5  # fp32 kernels against the fp32 reference, as the backend tests use
# Relative RMS error of a bf16 run against the fp32 reference. The GPU tests hold 2k-32k tokens to 5e-3; this
# small problem's rounding alone comes near that (about 4.3e-3 for dq), and a real fault is far larger.
LOW_PRECISION_RMS = 1e-2


def problem_size(sel_block_size: int, block_size: int, window_size: int) -> int:
    """Long enough for several selection blocks, a partial last block and a window edge, yet small."""
    return max(2 * sel_block_size + sel_block_size // 2 + 3, block_size + 3, min(window_size + 5, 300))


def _inputs(T: int, H: int, Hkv: int, D: int, block_size: int, block_stride: int, device, generator,
            lengths: list[int] | None = None):
    """The op's eight inputs for one row of T tokens (lengths: packed documents of those lengths)."""
    Tc = sum(num_compressed_blocks(n, block_size, block_stride) for n in (lengths or [T]))
    shapes = [(1, T, H, D), (1, Tc, Hkv, D), (1, Tc, Hkv, D)] + [(1, T, Hkv, D)] * 4
    xs = [torch.randn(s, generator=generator).to(device) for s in shapes]
    xs.append(torch.rand((1, T, H, 3), generator=generator).to(device))
    return xs


def _perturb_after(xs: list[torch.Tensor], t: int, block_size: int, block_stride: int, generator) -> list[torch.Tensor]:
    """New values for everything a query at position <= t must not see."""
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = (x.clone() for x in xs)
    first_hidden_block = max(0, math.ceil((t + 2 - block_size) / block_stride))  # i*d + l - 1 > t
    for x in (q, k_sel, v_sel, k_win, v_win):
        x[:, t + 1:] = torch.randn(x[:, t + 1:].shape, generator=generator).to(x.device) * 3
    gates[:, t + 1:] = torch.rand(gates[:, t + 1:].shape, generator=generator).to(gates.device)
    for x in (k_cmp, v_cmp):
        x[:, first_hidden_block:] = torch.randn(x[:, first_hidden_block:].shape, generator=generator).to(x.device) * 3
    return [q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates]


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over keys s <= t, query heads sharing their group's key/value head."""
    H, Hkv, T, D = q.shape[2], k.shape[2], q.shape[1], q.shape[3]
    k = k.repeat_interleave(H // Hkv, dim=2)
    v = v.repeat_interleave(H // Hkv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs, v)


def _close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    return bool(torch.allclose(a.float(), b.float(), atol=ATOL, rtol=RTOL)), err


def check_backend(backend: str, hyper: dict, n_heads: int, n_kv_heads: int, head_dim: int,
                  device: torch.device, seed: int = 0, documents: bool = False,
                  low_precision: torch.dtype | None = None) -> list[str]:
    """The failed properties, each one line; an empty list means the backend passed every check."""
    generator = torch.Generator().manual_seed(seed)
    G = n_heads // n_kv_heads
    H, Hkv, D = min(G, 4), 1, head_dim  # one group keeps it small; G > 1 still shares a selection
    l, d, lp = hyper["block_size"], hyper["block_stride"], hyper["sel_block_size"]
    T = problem_size(lp, l, hyper["window_size"])
    failures = []

    def run(xs, **override):
        return nsa_attention(*xs, **{**hyper, **override}, backend=backend)

    xs = _inputs(T, H, Hkv, D, l, d, device, generator)
    with torch.no_grad():
        out = run(xs)
        t = T // 2
        changed = run(_perturb_after(xs, t, l, d, generator))
    same, err = _close(out[:, :t + 1], changed[:, :t + 1])
    if not same:
        failures.append(f"causality: outputs at positions <= {t} moved by {err:.2e} when only later inputs changed")
    if torch.allclose(out[:, t + 1:], changed[:, t + 1:]):
        failures.append(f"causality check is void: changing inputs after position {t} left later outputs unchanged")

    every_block = num_selection_blocks(T, lp)
    with torch.no_grad():
        dense = dense_causal_attention(xs[0], xs[3], xs[4])
        gates = torch.zeros_like(xs[7])
        gates[..., 1] = 1.0
        sel_only = run([*xs[:7], gates], num_selected=every_block)
        dense_win = dense_causal_attention(xs[0], xs[5], xs[6])
        gates = torch.zeros_like(xs[7])
        gates[..., 2] = 1.0
        win_only = run([*xs[:7], gates], window_size=T)
    for what, mine, ref in (("selected branch with n >= Ts", sel_only, dense),
                            ("window branch with w >= T", win_only, dense_win)):
        same, err = _close(mine, ref)
        if not same:
            failures.append(f"{what} is not dense causal attention (max error {err:.2e})")

    if backend == "reference":
        return failures
    failures += _parity(xs, hyper, backend, generator)
    # Three documents, each past its first selection block and holding at least two compressed blocks (a
    # single one would make its dK exactly zero), ending mid-block.
    shortest = max(lp + lp // 2 + 1, l + d + 1)
    lengths = [shortest + 2, shortest, shortest + 5]
    if documents:
        packed = _inputs(sum(lengths), H, Hkv, D, l, d, device, generator, lengths)
        failures += _parity(packed, hyper, backend, generator, lengths, "packed documents: ")
    if low_precision is not None:
        rows = lengths if documents else None
        whole_group = _inputs(sum(lengths) if documents else T, G, 1, D, l, d, device, generator, rows)
        failures += _parity(whole_group, hyper, backend, generator, rows,
                            f"{str(low_precision).removeprefix('torch.')}, {G} heads a group: ", low_precision)
    return failures


def _relative_rms(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """RMS of a - b over that of b, or over `floor` where b is smaller (a gradient that is exactly zero,
    as dK of a window of one key, leaves only rounding noise in a half type)."""
    rms = (a.float() - b.float()).pow(2).mean().sqrt()
    return (rms / b.float().pow(2).mean().sqrt().clamp_min(floor)).item()


def _parity(xs: list[torch.Tensor], hyper: dict, backend: str, generator, lengths: list[int] | None = None,
            what: str = "", dtype: torch.dtype | None = None) -> list[str]:
    """The backend against the fp32 reference on the same inputs (with dtype: rounded to it, the backend
    computing in it), outputs and every gradient."""
    packing = {}
    if lengths is not None:
        packing["cu_seqlens"] = torch.tensor([0, *lengths], device=xs[0].device).cumsum(0)
    if dtype is not None:
        xs = [x.to(dtype) for x in xs]
    mine_in = [x.clone().requires_grad_() for x in xs]
    ref_in = [x.detach().float().requires_grad_() for x in xs]
    mine = nsa_attention(*mine_in, **hyper, backend=backend, **packing)
    ref = nsa_attention(*ref_in, **hyper, backend="reference", **packing)
    grad_out = torch.randn(ref.shape, generator=generator).to(ref.device)
    mine_grads = torch.autograd.grad(mine, mine_in, grad_out.to(mine.dtype))
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out)
    floor = 1e-3 * grad_out.pow(2).mean().sqrt().item()  # gradients far below the upstream one's scale count as 0
    failures = []
    names = ["o", "dq", "dk_cmp", "dv_cmp", "dk_sel", "dv_sel", "dk_win", "dv_win", "dgates"]
    for name, a, b in zip(names, (mine, *mine_grads), (ref, *ref_grads)):
        if dtype is None:
            same, err = _close(a, b)
            if not same:
                failures.append(f"{what}{name} differs from the reference by up to {err:.2e} (tolerance {ATOL:g})")
        elif _relative_rms(a, b, floor) > LOW_PRECISION_RMS:
            failures.append(f"{what}{name} differs from the fp32 reference: relative RMS error "
                            f"{_relative_rms(a, b, floor):.1e} (tolerance {LOW_PRECISION_RMS:g})")
    return failures
