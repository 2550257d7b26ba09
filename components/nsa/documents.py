"""Packed documents (NSA_SPEC.md section 4): the `cu_seqlens` contract and the spans it implies.

`cu_seqlens` is a 1-D integer tensor [N + 1] of document starts: cu_seqlens[0] = 0, strictly
increasing, cu_seqlens[-1] = T, with B = 1. Document k occupies tokens [cu[k], cu[k+1]) and owns
Tc_k complete compressed blocks, stored one document after another in k_cmp / v_cmp.

`cu_seqlens_q` (an extension beyond the spec, for context parallelism): the same N documents'
query counts, strictly increasing, starting at 0. Document k then has all its keys but only its last
Lq_k = cu_q[k+1] - cu_q[k] queries (queries at its positions Lk_k - Lq_k .. Lk_k - 1), as
flash-attn's varlen causal attention aligns a shorter query run to the end of its keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from components.nsa.compression import num_compressed_blocks
from components.nsa.tensor_memo import TensorMemo

# What dim 1 of a packed input counts: queries, key tokens, or compressed blocks.
QUERY, TOKEN, BLOCK = "query", "token", "block"
ATTENTION_INPUT_KINDS = (QUERY, BLOCK, BLOCK, TOKEN, TOKEN, TOKEN, TOKEN, QUERY)  # q, k_cmp, v_cmp, ..., gates


def check_cu_seqlens_tensor(cu_seqlens, batch: int, device: torch.device) -> None:
    """What is known without reading the values (all a compiled graph can check while tracing)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of document starts, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1] with N >= 1 documents, got "
                         f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}; put all inputs on one device")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch must be one packed row (B = 1), got B = {batch}; flatten the "
                         f"rows into one, each row end a document end")


# Host copies of offsets tensors: a model passes one cu_seqlens to every layer, and reading a GPU tensor's values
# waits for the GPU, so an eager forward reads it once, not once per layer and check. An in-place change of the
# tensor reads it again.
_HOST_VALUES = TensorMemo()


# Offsets tensors their maker never writes again once made (a model's layout, built on the host for each batch):
# the Triton backend keeps its kernel tables with these (triton/packing.kept), one set for every layer. Only these:
# an offsets tensor computed inside a compiled graph may be a buffer the graph's own kernels write again, under the
# same tensor and version counter.
_WRITTEN_ONCE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def written_once(*offsets: torch.Tensor) -> None:
    """Marks offsets tensors (cu_seqlens, cu_seqlens_q) as never written after this: kernels may keep what they
    derive from them for as long as the tensors live."""
    for t in offsets:
        _WRITTEN_ONCE[t] = True


def is_written_once(offsets: torch.Tensor) -> bool:
    return offsets in _WRITTEN_ONCE


def host_values(offsets: torch.Tensor) -> tuple[int, ...]:
    """offsets.tolist() as Python ints, read from the device once per tensor and version."""
    def read() -> tuple[int, ...]:
        return tuple(int(x) for x in offsets.tolist())

    if offsets.is_inference():  # no version counter to tell an in-place change by
        return read()
    return _HOST_VALUES.get(offsets, "values", read)


def document_starts(cu_seqlens: torch.Tensor, num_tokens: int) -> list[int]:
    """The document starts as a Python list ending with T, checked (one host read of the tensor)."""
    starts = list(host_values(cu_seqlens))
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {num_tokens}, got {starts[0]} .. {starts[-1]}")
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty document), got {starts}")
    return starts


def compressed_starts(starts: list[int], block_size: int, block_stride: int) -> list[int]:
    """Where each document's compressed blocks start in the packed k_cmp (ending with their total)."""
    out = [0]
    for a, b in zip(starts, starts[1:]):
        out.append(out[-1] + num_compressed_blocks(b - a, block_size, block_stride))
    return out


def document_slices(cu_seqlens: torch.Tensor, num_tokens: int, block_size: int,
                    block_stride: int) -> list[tuple[slice, slice]]:
    """(token slice, compressed-block slice) of every document, the values checked."""
    starts = document_starts(cu_seqlens, num_tokens)
    cmp = compressed_starts(starts, block_size, block_stride)
    return [(slice(a, b), slice(c, e)) for a, b, c, e in zip(starts, starts[1:], cmp, cmp[1:])]


def query_counts(cu_seqlens_q: torch.Tensor, token_slices: list[slice], num_queries: int | None = None) -> list[int]:
    """Each document's query count from cu_seqlens_q (checked against its key count, and their total
    against num_queries, q's length, when given)."""
    starts = list(host_values(cu_seqlens_q))
    if len(starts) != len(token_slices) + 1 or starts[0] != 0:
        raise ValueError(f"cu_seqlens_q must hold {len(token_slices) + 1} query starts from 0, one per document of "
                         f"cu_seqlens and the end, got {starts}")
    if num_queries is not None and starts[-1] != num_queries:
        raise ValueError(f"cu_seqlens_q must end at Tq = {num_queries} (q's queries), got {starts[-1]}")
    counts = [b - a for a, b in zip(starts, starts[1:])]
    for k, (count, tokens) in enumerate(zip(counts, token_slices)):
        if not 1 <= count <= tokens.stop - tokens.start:
            raise ValueError(f"document {k} has {tokens.stop - tokens.start} keys but {count} queries in cu_seqlens_q; "
                             f"a document's queries are its last positions: at least one, at most one per key")
    return counts


def per_document(fn, tensors: tuple, kinds: tuple, cu_seqlens, block_size: int, block_stride: int,
                 cu_seqlens_q=None, num_tokens: int | None = None):
    """fn(*tensors, q_start=...) on each packed document's own slices (NSA_SPEC.md section 4), each
    output list concatenated back along dim 1. Documents of equal length (rows cut from one long
    document, say) run together as one batch: each row of a batch is computed on its own, so this
    changes nothing but the number of calls. With cu_seqlens_q a document's queries (QUERY inputs)
    are its last ones, and fn gets the position of the first. Without cu_seqlens, fn(*tensors,
    q_start=0) once. num_tokens: the documents' total length where no TOKEN input tells it."""
    if cu_seqlens is None:
        return fn(*tensors, q_start=0)
    total = tensors[kinds.index(TOKEN)].shape[1] if num_tokens is None else num_tokens
    slices = document_slices(cu_seqlens, total, block_size, block_stride)
    for x, kind in zip(tensors, kinds):
        if kind == BLOCK and x.shape[1] != slices[-1][1].stop:
            raise ValueError(f"k_cmp / v_cmp hold {x.shape[1]} compressed blocks, but the documents of cu_seqlens "
                             f"have {slices[-1][1].stop} with block_size {block_size} and block_stride {block_stride}")
    lengths = [tokens.stop - tokens.start for tokens, _ in slices]
    num_queries = tensors[kinds.index(QUERY)].shape[1] if QUERY in kinds else None
    counts = lengths if cu_seqlens_q is None else query_counts(cu_seqlens_q, [tokens for tokens, _ in slices],
                                                                num_queries)
    query_ends = torch.tensor(counts).cumsum(0).tolist()
    queries = [slice(end - count, end) for end, count in zip(query_ends, counts)]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for index, (length, count) in enumerate(zip(lengths, counts)):
        by_shape.setdefault((length, count), []).append(index)
    pick = {QUERY: lambda i: queries[i], TOKEN: lambda i: slices[i][0], BLOCK: lambda i: slices[i][1]}
    parts: list = [None] * len(slices)
    for (length, count), members in by_shape.items():
        batch = [torch.cat([x[:, pick[kind](i)] for i in members]) for x, kind in zip(tensors, kinds)]
        out = fn(*batch, q_start=length - count)
        for row, i in enumerate(members):
            parts[i] = out[row:row + 1] if isinstance(out, torch.Tensor) else [o[row:row + 1] for o in out]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=1)
    return [torch.cat(column, dim=1) for column in zip(*parts)]


@dataclass(frozen=True)
class DocumentLayout:
    """What a packed row's documents mean for the layers around the op, all on the row's device:
    cu_seqlens [N + 1]; positions [T], each token's position in its own document (for RoPE);
    block_starts [Tc], the row token where each compressed block begins (blocks never straddle a
    boundary); block_positions [Tc], each block's last token within its document (where its key is
    rotated)."""

    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    block_starts: torch.Tensor
    block_positions: torch.Tensor


def compressed_counts(lengths: torch.Tensor, block_size: int, block_stride: int) -> torch.Tensor:
    """Complete compressed blocks of documents of these lengths (num_compressed_blocks, vectorised)."""
    return torch.where(lengths >= block_size, (lengths - block_size).div(block_stride, rounding_mode="floor") + 1, 0)


def token_documents(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the document of every token, its position within that document), int64 [T] each, for the packed
    row cu_seqlens describes (on its device; no checks)."""
    lengths = cu_seqlens.diff()
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device).repeat_interleave(lengths)
    return ids, torch.arange(ids.numel(), device=cu_seqlens.device) - cu_seqlens[ids]


def document_layout(cu_seqlens: torch.Tensor, num_tokens: int, block_size: int, block_stride: int) -> DocumentLayout:
    """The layout of one packed row of num_tokens tokens (checked as the op checks cu_seqlens), on
    cu_seqlens' device. Vectorised: no Python loop over documents."""
    document_starts(cu_seqlens, num_tokens)  # the checks
    cu = cu_seqlens.to("cpu", torch.int64)
    lengths = cu.diff()
    positions = token_documents(cu)[1]
    blocks = compressed_counts(lengths, block_size, block_stride)
    first_block = torch.cumsum(blocks, 0) - blocks  # each document's first block in the packed k_cmp
    block_index = torch.arange(int(blocks.sum())) - first_block.repeat_interleave(blocks)  # within its document
    block_starts = cu[:-1].repeat_interleave(blocks) + block_index * block_stride
    block_positions = block_index * block_stride + (block_size - 1)
    device = cu_seqlens.device
    return DocumentLayout(cu_seqlens, *(x.to(device) for x in (positions, block_starts, block_positions)))


def cu_seqlens_of_rows(document_starts: torch.Tensor) -> torch.Tensor:
    """document_starts [B, T] bool (True where a token opens a document) -> cu_seqlens [N + 1] int64 on
    the host, of the B rows read as one packed row. Each row's first token opens a document whatever
    the mask says: a row end is a document end."""
    if (not isinstance(document_starts, torch.Tensor) or document_starts.dim() != 2
            or document_starts.dtype != torch.bool):
        what = f"{document_starts.dtype} of shape {tuple(document_starts.shape)}" if isinstance(
            document_starts, torch.Tensor) else type(document_starts).__name__
        raise ValueError(f"document_starts must be a bool tensor [B, T] (True where a document starts), got {what}")
    starts = document_starts.to("cpu").clone()
    starts[:, 0] = True
    return torch.cat([starts.reshape(-1).nonzero().flatten(), torch.tensor([starts.numel()])])


def rows_layout(document_starts: torch.Tensor, block_size: int, block_stride: int,
                device: torch.device) -> DocumentLayout:
    """The layout of B rows of packed documents read as one row, built on the host (no device sync
    when document_starts lives there, as the loader gives it) and then moved to `device`."""
    cu_seqlens = cu_seqlens_of_rows(document_starts)
    layout = document_layout(cu_seqlens, document_starts.numel(), block_size, block_stride)
    layout = DocumentLayout(*(x.to(device, non_blocking=True) for x in (layout.cu_seqlens, layout.positions,
                                                                         layout.block_starts, layout.block_positions)))
    written_once(layout.cu_seqlens)
    return layout
