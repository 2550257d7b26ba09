"""Small helpers shared by the NSA Triton launchers: tile sizes, dot precision, device checks."""

from __future__ import annotations

import os

import numpy
import torch
import triton

from components.errors import UserError
from components.nsa.triton_limits import TRITON_MAX_HEAD_DIM

# Natural-log <-> base-2 conversion: kernels keep softmax statistics in base 2 (exp2 is the
# hardware instruction), so every logsumexp tensor the launchers pass around is log2-sum-exp2
# of the scaled logits.
LOG2E = 1.4426950408889634


# CUDA caps grid axis 0 at 2^31 - 1 programs and axes 1 and 2 at 65535: batch x heads alone can pass
# 65535 (a large batch of short rows), so launches use axis 0 only.
MAX_GRID_PROGRAMS = 2**31 - 1


def flat_grid(tiles: int, rows: int) -> tuple[int]:
    """A one-axis launch of `tiles` programs for each of `rows` (batch x heads); decoded in the
    kernel by tiles.grid_position."""
    programs = tiles * rows
    if programs > MAX_GRID_PROGRAMS:
        raise UserError(f"an NSA kernel launch needs {programs} programs, more than a GPU grid holds "
                        f"({MAX_GRID_PROGRAMS}); use a smaller batch or sequence per step")
    return (programs,)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get true fp32 products (TF32 would change results); half types are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (it reads TRITON_INTERPRET itself)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Triton's interpreter before 3.7 turns one-element arrays into loop bounds with int(array),
    which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars")."""
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run with NumPy "
                f"{numpy_version}; install numpy<2.4 or triton>=3.7 (on a GPU the compiled kernels are not affected)")
    return None


INTERPRETER_PROBLEM = interpreter_problem(triton.__version__, numpy.__version__)


def cpu_tensors_allowed() -> bool:
    """Whether launchers may take CPU tensors: under the interpreter (offline compilation patches
    this too, since it only compiles)."""
    return interpreting()


def check_kernel_device(x: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors; CPU tensors only work under Triton's interpreter."""
    if x.is_cuda:
        return
    if x.device.type == "cpu" and cpu_tensors_allowed():
        if interpreting() and INTERPRETER_PROBLEM:
            raise UserError(INTERPRETER_PROBLEM)
        return
    raise UserError(
        f"NSA backend 'triton' needs CUDA tensors, got tensors on {x.device}; move the model to a GPU "
        "or choose backend 'reference'"
    )


def check_kernel_dtype(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UserError(
            f"NSA backend 'triton' supports float16, bfloat16 and float32, got {x.dtype}; cast the inputs "
            "or choose backend 'reference' (it also handles float64)"
        )


def check_head_dim(head_dim: int) -> None:
    if head_dim > TRITON_MAX_HEAD_DIM:
        raise UserError(
            f"NSA backend 'triton' supports head dims up to {TRITON_MAX_HEAD_DIM}, got {head_dim}; use smaller "
            "heads or backend 'reference'"
        )


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take strides for every dim but the last, which must be dense."""
    return x if x.stride(-1) == 1 else x.contiguous()
