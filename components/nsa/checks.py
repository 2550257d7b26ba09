"""The NSA op's input checks (NSA_SPEC.md): hyperparameters, then the tensors' shapes, dtypes and devices.

A leaf: it imports no backend, so the op (op.py) and a backend's own public entry points can both
use it without importing each other. The op runs these checks once per call, before dispatching;
a backend called through the op gets checked inputs.
"""

from __future__ import annotations

import torch

from components.nsa.compression import num_compressed_blocks
from components.nsa.documents import check_cu_seqlens_tensor, compressed_starts, document_starts, query_counts
from components.nsa.hyperparams import check_hyperparameters


def check_q_start(q_start: int) -> None:
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


def _num_compressed(q, k_cmp, num_keys: int, block_size: int, block_stride: int, cu_seqlens) -> int:
    """Tc the op expects: from the key count, or summed over the packed documents (while compiling
    those are data, so k_cmp's own count stands, and the op checks it when it runs)."""
    if cu_seqlens is None:
        return num_compressed_blocks(num_keys, block_size, block_stride)
    check_cu_seqlens_tensor(cu_seqlens, q.shape[0], q.device)
    if torch.compiler.is_compiling():
        return k_cmp.shape[1]
    return compressed_starts(document_starts(cu_seqlens, num_keys), block_size, block_stride)[-1]


def _tc_rule(num_keys: int, block_size: int, block_stride: int, cu_seqlens) -> str:
    """How Tc follows, for a message (built only on failure: formatting a symbolic size would pin it)."""
    where = f"{num_keys} keys" if cu_seqlens is None else f"the {cu_seqlens.shape[0] - 1} documents of cu_seqlens"
    return f"for {where} with block_size {block_size} and block_stride {block_stride}"


def check_selection_inputs(q, k_cmp, *, q_start: int, block_size: int, block_stride: int, cu_seqlens=None) -> None:
    """Shapes of q [B, Tq, H, D] and k_cmp [B, Tc, Hkv, D] with Tc = Tc(q_start + Tq), or the documents' sum."""
    _check_tensor("q", q, q.device if isinstance(q, torch.Tensor) else None)
    _check_tensor("k_cmp", k_cmp, q.device)
    B, Tq, H, D = q.shape
    Hkv = k_cmp.shape[2]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv} (k_cmp {_shape(k_cmp)})")
    Tc = _num_compressed(q, k_cmp, q_start + Tq, block_size, block_stride, cu_seqlens)
    if _shape(k_cmp) != (B, Tc, Hkv, D):
        raise ValueError(f"k_cmp must be [B, Tc, Hkv, D] = {(B, Tc, Hkv, D)} "
                         f"{_tc_rule(q_start + Tq, block_size, block_stride, cu_seqlens)}, got {_shape(k_cmp)}")


def check_attention_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, q_start: int,
                           block_size: int, block_stride: int, cu_seqlens=None, cu_seqlens_q=None,
                           window_start: int = 0) -> None:
    """Shapes, dtypes and devices of the op's eight tensors (keys at positions 0 .. q_start + Tq - 1, or
    with cu_seqlens_q as many as k_sel has: each document's queries are its last ones; the window's keys
    from window_start on)."""
    _check_tensor("q", q, q.device if isinstance(q, torch.Tensor) else None)
    named = dict(k_cmp=k_cmp, v_cmp=v_cmp, k_sel=k_sel, v_sel=v_sel, k_win=k_win, v_win=v_win, gates=gates)
    for name, x in named.items():
        _check_tensor(name, x, q.device)
    B, Tq, H, D = q.shape
    Tk = q_start + Tq
    if cu_seqlens_q is not None:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_q (each document's query count) needs cu_seqlens (its key count)")
        check_cu_seqlens_tensor(cu_seqlens_q, B, q.device)
        if cu_seqlens_q.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_q must list the same documents as cu_seqlens: shape "
                             f"{tuple(cu_seqlens.shape)}, got {tuple(cu_seqlens_q.shape)}")
        Tk = k_sel.shape[1]
        if not torch.compiler.is_compiling():  # values: read as cu_seqlens's are (a compiled graph has none)
            starts = document_starts(cu_seqlens, Tk)
            query_counts(cu_seqlens_q, [slice(a, b) for a, b in zip(starts, starts[1:])], Tq)
    Hkv = k_sel.shape[2]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv} (k_sel {_shape(k_sel)})")
    for name in ("k_sel", "v_sel", "k_win", "v_win"):
        held = Tk - window_start if name in ("k_win", "v_win") else Tk
        if _shape(named[name]) != (B, held, Hkv, D):
            since = f" - window_start {window_start}" if held != Tk else ""
            raise ValueError(
                f"{name} must be [B, Tk{since}, Hkv, D] = {(B, held, Hkv, D)} (Tk = q_start + Tq = {q_start} + {Tq}), "
                f"got {_shape(named[name])}"
            )
    Tc = _num_compressed(q, k_cmp, Tk, block_size, block_stride, cu_seqlens)
    for name in ("k_cmp", "v_cmp"):
        if _shape(named[name]) != (B, Tc, Hkv, D):
            raise ValueError(f"{name} must be [B, Tc, Hkv, D] = {(B, Tc, Hkv, D)} "
                             f"{_tc_rule(Tk, block_size, block_stride, cu_seqlens)}, got {_shape(named[name])}")
    if _shape(gates) != (B, Tq, H, 3):
        raise ValueError(f"gates must be [B, Tq, H, 3] = {(B, Tq, H, 3)} in order (cmp, sel, win), got {_shape(gates)}")


def _check_packed_start(q_start: int, cu_seqlens) -> None:
    if cu_seqlens is not None and q_start != 0:
        raise ValueError(f"cu_seqlens describes whole packed rows: q_start must be 0, got {q_start}")


def check_window_start(window_start: int, q_start: int, window_size: int) -> None:
    """The window's keys may start no later than the first query's window: max(0, q_start - w + 1)."""
    first = max(0, q_start - window_size + 1)
    if isinstance(window_start, bool) or not isinstance(window_start, int) or not 0 <= window_start <= first:
        raise ValueError(f"window_start must be a Python int in 0..{first} (the first query at {q_start} sees keys "
                         f"from {first} with window_size {window_size}), got {window_start!r}")


def check_attention_call(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, q_start: int, block_size: int,
                         block_stride: int, sel_block_size: int, num_selected: int, window_size: int,
                         cu_seqlens=None, cu_seqlens_q=None, window_start: int = 0) -> None:
    """Everything the op checks about one call computing attention (UserError or ValueError)."""
    check_q_start(q_start)
    _check_packed_start(q_start, cu_seqlens)
    check_hyperparameters(block_size, block_stride, sel_block_size, num_selected, window_size)
    check_window_start(window_start, q_start, window_size)
    check_attention_inputs(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=q_start,
                           block_size=block_size, block_stride=block_stride, cu_seqlens=cu_seqlens,
                           cu_seqlens_q=cu_seqlens_q, window_start=window_start)


def check_selection_call(q, k_cmp, *, q_start: int, block_size: int, block_stride: int, sel_block_size: int,
                         num_selected: int, cu_seqlens=None) -> None:
    """Everything the op checks about one call selecting blocks."""
    check_q_start(q_start)
    _check_packed_start(q_start, cu_seqlens)
    # The window size plays no part in selection; 1 is always valid.
    check_hyperparameters(block_size, block_stride, sel_block_size, num_selected, 1)
    check_selection_inputs(q, k_cmp, q_start=q_start, block_size=block_size, block_stride=block_stride,
                           cu_seqlens=cu_seqlens)
