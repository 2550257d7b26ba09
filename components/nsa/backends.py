"""The one table of NSA backends: a name -> the function that computes the op.

Every backend computes the reference's function (tests/test_nsa_reference.py holds the
properties); the name only picks the speed. Built in: 'reference' (exact PyTorch) and 'triton'
(imported on first use, so a machine without Triton or a GPU can still use the reference). Others
are added with `register_backend` (the engine's registry does it for plugins' attention_backend
parts). A backend's function takes the op's eight tensors and its five hyperparameters as keywords
(nsa_attention's signature minus `backend`) and gets inputs the op has already checked; it is passed
`cu_seqlens=` only for packed documents, so a backend that does not take them keeps working,
`cu_seqlens_q=` only under context parallelism, and `max_seqlen=` (a hint) only if it names it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from components.errors import UserError
from components.nsa.reference_op import reference_attention
from components.nsa.triton_limits import TRITON_MAX_HEAD_DIM


@dataclass(frozen=True)
class Backend:
    name: str
    attention: Callable[..., object]
    doc: str
    built_in: bool
    max_head_dim: int | None = None  # a limit a recipe is checked against before anything is built

    @property
    def takes_documents(self) -> bool:
        """Whether the function takes cu_seqlens (packed documents)."""
        parameters = inspect.signature(self.attention).parameters
        return "cu_seqlens" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())

    @property
    def takes_query_offsets(self) -> bool:
        """Whether the function names cu_seqlens_q (fewer queries than keys per document: context
        parallelism); only an explicit parameter counts."""
        return "cu_seqlens_q" in inspect.signature(self.attention).parameters

    @property
    def takes_max_seqlen(self) -> bool:
        """Whether the function names max_seqlen (a bound on the documents' lengths: a hint, no result depends
        on it); only an explicit parameter counts."""
        return "max_seqlen" in inspect.signature(self.attention).parameters


def _reference(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size: int, block_stride: int,
               sel_block_size: int, num_selected: int, window_size: int, cu_seqlens=None, cu_seqlens_q=None):
    return reference_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, block_size, block_stride,
                               sel_block_size, num_selected, window_size, cu_seqlens, cu_seqlens_q)


def _triton(*tensors, cu_seqlens=None, cu_seqlens_q=None, max_seqlen=None, **hyper):
    try:
        import components.nsa.triton as nsa_triton
    except ImportError as exc:
        raise UserError(
            f"NSA backend 'triton' is not available here ({exc}); install triton and run on a CUDA GPU, "
            "or choose backend 'reference'"
        ) from exc
    return nsa_triton.attention_on_checked_inputs(*tensors, cu_seqlens=cu_seqlens, cu_seqlens_q=cu_seqlens_q,
                                                  max_seqlen=max_seqlen, **hyper)


_TABLE: dict[str, Backend] = {
    "reference": Backend("reference", _reference, "exact PyTorch, chunked over queries", True),
    "triton": Backend("triton", _triton, "Triton kernels (CUDA, or Triton's interpreter)", True,
                      max_head_dim=TRITON_MAX_HEAD_DIM),
}
BACKENDS = tuple(_TABLE)  # the built-in backends, proven equal by the test suite


def register_backend(name: str, attention: Callable[..., object], *, doc: str = "", replace: bool = False) -> None:
    """Add a backend computing the reference's function; a built-in one is never replaced."""
    if name in BACKENDS:
        raise ValueError(f"NSA backend {name!r} is built in and cannot be replaced; register yours under a new "
                         f"name and choose it with model.nsa.backend")
    if name in _TABLE and not replace:
        raise ValueError(f"NSA backend {name!r} is already registered; pass replace=True to override it")
    _TABLE[name] = Backend(name, attention, doc, False)


def unregister_backend(name: str) -> None:
    """Remove an added backend (built-in ones stay)."""
    if name not in BACKENDS:
        _TABLE.pop(name, None)


def available_backends() -> tuple[str, ...]:
    return BACKENDS + tuple(sorted(name for name in _TABLE if name not in BACKENDS))


def get_backend(name: str) -> Backend:
    try:
        return _TABLE[name]
    except KeyError:
        raise UserError(f"unknown NSA backend {name!r}; available backends: "
                        f"{', '.join(available_backends())}") from None
