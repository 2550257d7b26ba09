"""The NSA op contract (NSA_SPEC.md): check the call once (checks.py), then dispatch by name
through the backend table (backends.py). Every backend computes the same function; the name only
picks the speed.
"""

from __future__ import annotations

import torch

from components.errors import UserError
from components.nsa.backends import get_backend
from components.nsa.checks import check_attention_call, check_selection_call
from components.nsa.decode import nsa_attention_one_query
from components.nsa.documents import BLOCK, QUERY, TOKEN, per_document
from components.nsa.reference import nsa_attention_at_reference
from components.nsa.selection import select_blocks_at_reference


def nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, block_size: int, block_stride: int,
                  sel_block_size: int, num_selected: int, window_size: int, backend: str = "reference",
                  cu_seqlens: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                  max_seqlen: int | None = None) -> torch.Tensor:
    """NSA over a whole sequence: o [B, T, H, D] in q's dtype. Inputs already compressed and rotated.

    cu_seqlens (document starts [N + 1], B = 1): a packed row, computed as each document on its own,
    with k_cmp / v_cmp holding the documents' compressed blocks one document after another.
    cu_seqlens_q (with cu_seqlens; beyond the spec): q and gates hold only each document's last
    cu_seqlens_q[k+1] - cu_seqlens_q[k] queries, o likewise (documents.py). Context parallelism
    runs a rank's queries against the gathered keys this way.
    max_seqlen (beyond the spec, as flash-attn's): a bound on every document's length (a packed row's
    documents are on the device, out of the host's sight). It changes no result: a backend may size its
    work by it (the Triton backend's selected-branch layout) and is passed it only if its function names it.
    """
    chosen = get_backend(backend)
    hyper = dict(block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                 num_selected=num_selected, window_size=window_size)
    check_attention_call(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=0, cu_seqlens=cu_seqlens,
                         cu_seqlens_q=cu_seqlens_q, **hyper)
    if cu_seqlens_q is not None:
        if not chosen.takes_query_offsets:
            raise UserError(f"NSA backend {backend!r} does not take query offsets (its function has no cu_seqlens_q "
                            f"parameter), which context parallelism needs. Fix: choose backend 'reference', or set "
                            f"parallelism.context_parallel_degree = 1.")
        hyper["cu_seqlens_q"] = cu_seqlens_q
    if cu_seqlens is not None:
        if not chosen.takes_documents:
            raise UserError(f"NSA backend {backend!r} does not take packed documents (its function has no "
                            f"cu_seqlens parameter). Fix: choose backend 'reference' or 'triton', or set "
                            f"model.document_masking = false.")
        hyper["cu_seqlens"] = cu_seqlens  # passed only when given: a backend without packing keeps working
    if max_seqlen is not None:
        _check_max_seqlen(max_seqlen)
        if chosen.takes_max_seqlen:
            hyper["max_seqlen"] = max_seqlen
    return chosen.attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, **hyper)


def _check_max_seqlen(max_seqlen) -> None:
    if isinstance(max_seqlen, (int, torch.SymInt)) and not isinstance(max_seqlen, bool):
        if torch.compiler.is_compiling():
            # A size, or a value read from the device (.item()), is symbolic: no branch on it, and no formatting of
            # it (which would fix it to this trace's value: a recompile for every length). No message either: inside
            # an activation-checkpointed block the check is a graph node, and a function as its argument kept
            # inductor from caching the compiled graph (it cannot pickle one).
            torch._check(max_seqlen >= 1)
            return
        if max_seqlen >= 1:
            return
    raise UserError(f"nsa_attention: max_seqlen must be a positive int (a bound on the documents' lengths), not "
                    f"{max_seqlen!r}. Fix: pass the longest document's length or the row's, or leave it out.")


def nsa_attention_at(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, q_start: int, block_size: int,
                     block_stride: int, sel_block_size: int, num_selected: int, window_size: int,
                     window_start: int = 0) -> torch.Tensor:
    """NSA for Tq queries at positions q_start .. q_start + Tq - 1 against keys 0 .. q_start + Tq - 1.

    The decode form: a KV-cache step passes Tq = 1 and q_start = tokens already cached, with
    k_sel/v_sel/k_win/v_win holding every cached key plus the new one and k_cmp the Tc(Tk)
    complete compressed blocks. nsa_attention is this with q_start = 0. One query reads only the keys
    its branches see (decode.py); more run the reference.
    window_start: k_win / v_win hold only the keys from this position on (a cache keeps the window's
    recent keys alone), at most max(0, q_start - window_size + 1), the first query's first key.
    """
    hyper = dict(block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size,
                 num_selected=num_selected, window_size=window_size, window_start=window_start)
    check_attention_call(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=q_start, **hyper)
    compute = nsa_attention_one_query if q.shape[1] == 1 else nsa_attention_at_reference
    return compute(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=q_start, **hyper)


def select_blocks(q, k_cmp, *, block_size: int, block_stride: int, sel_block_size: int,
                  num_selected: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Selected blocks LongTensor [B, T, Hkv, n]: ascending, -1 in the trailing unused slots. With
    cu_seqlens, block indices count from each query's own document start."""
    if cu_seqlens is None:
        return select_blocks_at(q, k_cmp, q_start=0, block_size=block_size, block_stride=block_stride,
                                sel_block_size=sel_block_size, num_selected=num_selected)
    check_selection_call(q, k_cmp, q_start=0, block_size=block_size, block_stride=block_stride,
                         sel_block_size=sel_block_size, num_selected=num_selected, cu_seqlens=cu_seqlens)
    return _selection_per_document(q, k_cmp, (TOKEN, BLOCK), cu_seqlens, block_size=block_size,
                                   block_stride=block_stride, sel_block_size=sel_block_size, num_selected=num_selected)


def _selection_per_document(q, k_cmp, kinds, cu_seqlens, cu_seqlens_q=None, num_tokens=None, **hyper):
    def select(q_doc, k_doc, q_start):
        return select_blocks_at_reference(q_doc, k_doc, q_start=q_start, **hyper)

    return per_document(select, (q, k_cmp), kinds, cu_seqlens, hyper["block_size"], hyper["block_stride"],
                        cu_seqlens_q, num_tokens)


def select_blocks_of_last_queries(q, k_cmp, *, cu_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor, num_keys: int,
                                  block_size: int, block_stride: int, sel_block_size: int,
                                  num_selected: int) -> torch.Tensor:
    """select_blocks for packed documents whose queries are their last ones (the op's query offsets,
    context parallelism): q [1, sum of query counts, H, D], k_cmp the compressed blocks of the
    documents' num_keys tokens; block indices count from each document's start. The reference math,
    for telemetry; the caller builds the tables from its own layout (not checked here)."""
    return _selection_per_document(q, k_cmp, (QUERY, BLOCK), cu_seqlens, cu_seqlens_q, num_keys, block_size=block_size,
                                   block_stride=block_stride, sel_block_size=sel_block_size, num_selected=num_selected)


def select_blocks_at(q, k_cmp, *, q_start: int, block_size: int, block_stride: int, sel_block_size: int,
                     num_selected: int) -> torch.Tensor:
    """Selected blocks [B, Tq, Hkv, n] for queries at positions q_start .. q_start + Tq - 1."""
    check_selection_call(q, k_cmp, q_start=q_start, block_size=block_size, block_stride=block_stride,
                         sel_block_size=sel_block_size, num_selected=num_selected)
    return select_blocks_at_reference(q, k_cmp, q_start=q_start, block_size=block_size, block_stride=block_stride,
                                      sel_block_size=sel_block_size, num_selected=num_selected)
