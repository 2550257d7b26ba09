"""The NSA op contract (NSA_SPEC.md): input checks and backend dispatch.

Every backend computes the same function; the name only picks the speed. The Triton backend is
imported on first use so that a machine without Triton or a GPU can still use the reference.
"""

from __future__ import annotations

import torch

from components.errors import UserError
from components.nsa.compression import num_compressed_blocks
from components.nsa.hyperparams import check_hyperparameters
from components.nsa.reference import nsa_attention_at_reference
from components.nsa.reference_op import reference_attention
from components.nsa.selection import select_blocks_at_reference

BACKENDS = ("reference", "triton")  # the built-in backends, proven equal by the test suite
_EXTRA_BACKENDS: dict = {}  # name -> nsa_attention-like callable (same signature, no `backend`)


def register_backend(name: str, attention) -> None:
    """Add a backend: `attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size,
    block_stride, sel_block_size, num_selected, window_size)` computing the reference's function."""
    if name in BACKENDS:
        raise ValueError(f"NSA backend {name!r} is built in and cannot be replaced")
    _EXTRA_BACKENDS[name] = attention


def available_backends() -> tuple[str, ...]:
    return BACKENDS + tuple(sorted(_EXTRA_BACKENDS))


def _triton_module():
    try:
        from components.nsa import triton as nsa_triton
    except ImportError as exc:
        raise UserError(
            f"NSA backend 'triton' is not available here ({exc}); install triton and run on a CUDA GPU, "
            "or choose backend 'reference'"
        ) from exc
    return nsa_triton


def _check_backend(backend: str) -> None:
    if backend not in available_backends():
        raise UserError(f"unknown NSA backend {backend!r}; available backends: {', '.join(available_backends())}")


def _check_q_start(q_start: int) -> None:
    if isinstance(q_start, bool) or not isinstance(q_start, int) or q_start < 0:
        raise ValueError(f"q_start must be a Python int >= 0 (the position of the first query), got {q_start!r}")


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_tensor(name: str, x, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions, got shape {_shape(x)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; put all inputs on one device")


def check_selection_inputs(q, k_cmp, *, q_start: int, block_size: int, block_stride: int) -> None:
    """Shapes of q [B, Tq, H, D] and k_cmp [B, Tc, Hkv, D] with Tc = Tc(q_start + Tq)."""
    _check_tensor("q", q, q.device if isinstance(q, torch.Tensor) else None)
    _check_tensor("k_cmp", k_cmp, q.device)
    B, Tq, H, D = q.shape
    Hkv = k_cmp.shape[2]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv} (k_cmp {_shape(k_cmp)})")
    Tc = num_compressed_blocks(q_start + Tq, block_size, block_stride)
    if _shape(k_cmp) != (B, Tc, Hkv, D):
        raise ValueError(
            f"k_cmp must be [B, Tc, Hkv, D] = {(B, Tc, Hkv, D)} for {q_start + Tq} keys with block_size "
            f"{block_size} and block_stride {block_stride}, got {_shape(k_cmp)}"
        )


def check_attention_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, q_start: int,
                           block_size: int, block_stride: int) -> None:
    """Shapes, dtypes and devices of the op's eight tensors (keys at positions 0 .. q_start + Tq - 1)."""
    _check_tensor("q", q, q.device if isinstance(q, torch.Tensor) else None)
    named = dict(k_cmp=k_cmp, v_cmp=v_cmp, k_sel=k_sel, v_sel=v_sel, k_win=k_win, v_win=v_win, gates=gates)
    for name, x in named.items():
        _check_tensor(name, x, q.device)
    B, Tq, H, D = q.shape
    Tk = q_start + Tq
    Hkv = k_sel.shape[2]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv} (k_sel {_shape(k_sel)})")
    token_shape = (B, Tk, Hkv, D)
    for name in ("k_sel", "v_sel", "k_win", "v_win"):
        if _shape(named[name]) != token_shape:
            raise ValueError(
                f"{name} must be [B, Tk, Hkv, D] = {token_shape} (Tk = q_start + Tq = {q_start} + {Tq}), "
                f"got {_shape(named[name])}"
            )
    Tc = num_compressed_blocks(Tk, block_size, block_stride)
    for name in ("k_cmp", "v_cmp"):
        if _shape(named[name]) != (B, Tc, Hkv, D):
            raise ValueError(
                f"{name} must be [B, Tc, Hkv, D] = {(B, Tc, Hkv, D)} for {Tk} keys with block_size {block_size} "
                f"and block_stride {block_stride}, got {_shape(named[name])}"
            )
    if _shape(gates) != (B, Tq, H, 3):
        raise ValueError(f"gates must be [B, Tq, H, 3] = {(B, Tq, H, 3)} in order (cmp, sel, win), got {_shape(gates)}")


def nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size: int, block_stride: int,
                  sel_block_size: int, num_selected: int, window_size: int, backend: str = "reference") -> torch.Tensor:
    """NSA over a whole sequence: o [B, T, H, D] in q's dtype. Inputs already compressed and rotated."""
    _check_backend(backend)
    check_hyperparameters(block_size, block_stride, sel_block_size, num_selected, window_size)
    check_attention_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=0,
                           block_size=block_size, block_stride=block_stride)
    hyper = dict(block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                 num_selected=num_selected, window_size=window_size)
    if backend == "triton":
        return _triton_module().nsa_attention_triton(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, **hyper)
    if backend in _EXTRA_BACKENDS:
        return _EXTRA_BACKENDS[backend](q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, **hyper)
    return reference_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_size, block_stride,
                               sel_block_size, num_selected, window_size)


def nsa_attention_at(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, q_start: int, block_size: int,
                     block_stride: int, sel_block_size: int, num_selected: int, window_size: int) -> torch.Tensor:
    """NSA for Tq queries at positions q_start .. q_start + Tq - 1 against keys 0 .. q_start + Tq - 1.

    The decode form: a KV-cache step passes Tq = 1 and q_start = tokens already cached, with
    k_sel/v_sel/k_win/v_win holding every cached key plus the new one and k_cmp the Tc(Tk)
    complete compressed blocks. nsa_attention is this with q_start = 0.
    """
    _check_q_start(q_start)
    check_hyperparameters(block_size, block_stride, sel_block_size, num_selected, window_size)
    check_attention_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=q_start,
                           block_size=block_size, block_stride=block_stride)
    return nsa_attention_at_reference(
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=q_start, block_size=block_size,
        block_stride=block_stride, sel_block_size=sel_block_size, num_selected=num_selected, window_size=window_size,
    )


def select_blocks(q, k_cmp, *, block_size: int, block_stride: int, sel_block_size: int,
                  num_selected: int) -> torch.Tensor:
    """Selected blocks LongTensor [B, T, Hkv, n]: ascending, -1 in the trailing unused slots."""
    return select_blocks_at(q, k_cmp, q_start=0, block_size=block_size, block_stride=block_stride,
                            sel_block_size=sel_block_size, num_selected=num_selected)


def select_blocks_at(q, k_cmp, *, q_start: int, block_size: int, block_stride: int, sel_block_size: int,
                     num_selected: int) -> torch.Tensor:
    """Selected blocks [B, Tq, Hkv, n] for queries at positions q_start .. q_start + Tq - 1."""
    _check_q_start(q_start)
    # The window size plays no part in selection; 1 is always valid.
    check_hyperparameters(block_size, block_stride, sel_block_size, num_selected, 1)
    check_selection_inputs(q, k_cmp, q_start=q_start, block_size=block_size, block_stride=block_stride)
    return select_blocks_at_reference(q, k_cmp, q_start=q_start, block_size=block_size, block_stride=block_stride,
                                      sel_block_size=sel_block_size, num_selected=num_selected)
