"""Packed documents (cu_seqlens, NSA_SPEC.md section 4) for the kernels: small int32 tables on the device.

Every kernel computes each document on its own: a program takes a tile of one document's queries
(or keys), never straddling a boundary, and counts positions from the document start, so a tile
does exactly what it would do in the document alone. A tile table says which document and which
tile of it each program takes. Tables are sized from shapes alone: N documents holding `total`
items in all have at most cdiv(total, block) + N tiles, so nothing waits on the GPU to learn the
boundaries (no host sync, nothing data-dependent for torch.compile). Programs past the real tiles
fall on an empty document appended after the last one, and do nothing.

    starts [N + 2]      where each document's items begin, then the end twice (the empty document)
    tile table [2, M]   row 0: the document of each of the M programs; row 1: its tile within it

Query offsets (cu_seqlens_q, context parallelism): a document then has fewer queries than keys, its
last ones; queries and keys have their own starts, and q_pos0 [N + 2] holds each document's first
query position (its key count minus its query count; 0 without offsets and for the empty document).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, TypeVar

import torch

from components.nsa.documents import is_written_once
from components.nsa.tensor_memo import TensorMemo
from components.nsa.triton.tile_configs import cdiv

Tensor = torch.Tensor
Built = TypeVar("Built")

# Tables kept by their offsets tensors. A model passes one cu_seqlens to every layer, and each layer's forward
# and backward launch some ten kernels over it: building the same tables for each launch was ~450 small device
# ops a packed layer (host time and tiny kernels, every layer of every step). Kept only for offsets their maker
# marked written once (documents.written_once: a model's layout; a tensor a compiled graph computed may be a
# buffer its kernels write again, unseen by the version counter), built again after an in-place change (the
# version counter), and never kept for an inference tensor (no counter), a tensor subclass, or off the device's
# default stream: CUDA graph trees warm up and capture on their own stream, allocating from the graph's pool, which
# must hold nothing past the run.
_KEPT = TensorMemo()  # cu_seqlens -> key -> what build gave; "queries" -> TensorMemo by cu_seqlens_q


def _keepable(t: Tensor | None) -> bool:
    if t is None:
        return True
    if type(t) is not torch.Tensor or t.is_inference() or not is_written_once(t):
        return False
    return not t.is_cuda or torch.cuda.current_stream(t.device) == torch.cuda.default_stream(t.device)


def kept(cu_seqlens: Tensor, cu_seqlens_q: Tensor | None, key: tuple, build: Callable[[], Built]) -> Built:
    """build(), made once per (cu_seqlens, cu_seqlens_q) tensors, their versions and `key` (which names what
    build makes and every other argument it reads). What build returns must not hold either tensor."""
    if not (_keepable(cu_seqlens) and _keepable(cu_seqlens_q)):
        return build()
    if cu_seqlens_q is None:
        return _KEPT.get(cu_seqlens, key, build)
    return _KEPT.get(cu_seqlens, "queries", TensorMemo).get(cu_seqlens_q, key, build)


def document_starts(cu_seqlens: Tensor) -> Tensor:
    """int32 [N + 2]: the token where each document starts, then T twice."""
    return torch.cat([cu_seqlens, cu_seqlens[-1:]]).to(torch.int32)


def key_starts(cu_seqlens: Tensor, key_stride: int, key_offset: int) -> Tensor:
    """int32 [N + 2]: where each document's keys start among the packed keys, then their total twice.

    A document of n tokens owns the keys i with i * key_stride + key_offset <= n - 1: its
    compressed blocks (stride d, offset l - 1), or its n tokens (stride 1, offset 0)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    # Floor division: a document shorter than key_offset + 1 gets a negative quotient, clamped to 0 keys.
    counts = (torch.div(lengths - 1 - key_offset, key_stride, rounding_mode="floor") + 1).clamp_min(0)
    ends = torch.cumsum(counts, 0)
    return torch.cat([ends.new_zeros(1), ends, ends[-1:]]).to(torch.int32)


def _tiles_per_document(starts: Tensor, block: int) -> Tensor:
    lengths = (starts[1:] - starts[:-1]).to(torch.int64)
    return torch.div(lengths + block - 1, block, rounding_mode="floor")  # [N + 1], 0 for the empty one


def tile_table(starts: Tensor, block: int, total: int) -> Tensor:
    """int32 [2, cdiv(total, block) + N]: (document, tile within it) of each program over the
    documents' items (tokens or keys) in tiles of `block`; the spare programs get (N, 0)."""
    num_docs = starts.shape[0] - 2
    tiles = _tiles_per_document(starts, block)
    ends = torch.cumsum(tiles, 0)
    ids = torch.arange(cdiv(total, block) + num_docs, device=starts.device)
    doc = torch.searchsorted(ends, ids, right=True).clamp_(max=num_docs)
    tile = torch.where(doc < num_docs, ids - (ends - tiles)[doc], 0)
    return torch.stack([doc, tile]).to(torch.int32)


def token_documents(starts: Tensor, num_tokens: int) -> Tensor:
    """int64 [T]: the document of every token."""
    tokens = torch.arange(num_tokens, device=starts.device, dtype=starts.dtype)
    return torch.searchsorted(starts[1:], tokens, right=True)


def query_positions_zero(cu_seqlens: Tensor, cu_seqlens_q: Tensor | None) -> Tensor:
    """int32 [N + 2]: each document's first query position (0 without query offsets), then 0 twice."""
    keys = cu_seqlens[1:] - cu_seqlens[:-1]
    first = keys - (cu_seqlens_q[1:] - cu_seqlens_q[:-1]) if cu_seqlens_q is not None else torch.zeros_like(keys)
    return torch.cat([first, first.new_zeros(2)]).to(torch.int32)


def query_token_table(cu_seqlens: Tensor, cu_seqlens_q: Tensor | None, num_queries: int) -> Tensor:
    """int32 [2, Tq] for the selected branch, which works query by query: row 0, where query t's
    document starts among the keys; row 1, the shift that makes t - shift the query's position in its
    document. Without query offsets both are the document's start."""
    q_starts = document_starts(cu_seqlens if cu_seqlens_q is None else cu_seqlens_q)
    docs = token_documents(q_starts, num_queries)
    k_starts = document_starts(cu_seqlens)
    shift = q_starts - query_positions_zero(cu_seqlens, cu_seqlens_q)
    return torch.stack([k_starts[docs], shift[docs]]).to(torch.int32)


class SelectionBlocks(NamedTuple):
    """Selection blocks of a packed row, numbered document after document (the unit of the
    selected branch's dK/dV): block j of document k has the number first_block[k] + j."""

    table: Tensor  # tile_table over the tokens in tiles of l': (document, j) of every number
    token_first: Tensor  # int64 [T]: the number of block 0 of each token's document


def selection_blocks(starts: Tensor, sel_block_size: int, num_tokens: int, query_starts: Tensor | None = None,
                     num_queries: int | None = None) -> SelectionBlocks:
    """The blocks of the documents' keys (starts over num_tokens tokens); token_first is per query, of
    query_starts over num_queries queries when the queries are not the keys (query offsets)."""
    tiles = _tiles_per_document(starts, sel_block_size)
    first = torch.cumsum(tiles, 0) - tiles
    if query_starts is None:
        query_starts, num_queries = starts, num_tokens
    return SelectionBlocks(tile_table(starts, sel_block_size, num_tokens),
                           first[token_documents(query_starts, num_queries)])


class DocumentTables:
    """The packed documents of one launcher call as kernel arguments: the documents' query starts,
    their key starts (keys at i * key_stride + key_offset, as key_starts), their first query
    positions, and per launch a tile table over queries or keys. Without cu_seqlens the row is one
    document and the kernels get no tables (PACKED false: nothing extra is loaded)."""

    def __init__(self, cu_seqlens: Tensor | None, key_stride: int, key_offset: int,
                 cu_seqlens_q: Tensor | None = None):
        self.packed = cu_seqlens is not None
        queries = cu_seqlens if cu_seqlens_q is None else cu_seqlens_q
        self.q_starts = document_starts(queries) if self.packed else None
        self.k_starts = key_starts(cu_seqlens, key_stride, key_offset) if self.packed else None
        self.q_pos0 = query_positions_zero(cu_seqlens, cu_seqlens_q) if self.packed else None
        self._tile_tables: dict[tuple[int, int, bool], Tensor] = {}

    @classmethod
    def of(cls, cu_seqlens: Tensor | None, key_stride: int, key_offset: int,
           cu_seqlens_q: Tensor | None = None) -> DocumentTables:
        """The tables of these offsets tensors, kept with them (see `kept`): one set for every layer and launch."""
        if cu_seqlens is None:
            return cls(None, key_stride, key_offset)
        return kept(cu_seqlens, cu_seqlens_q, ("documents", key_stride, key_offset),
                    lambda: cls(cu_seqlens, key_stride, key_offset, cu_seqlens_q))

    def tiles(self, block: int, total: int, over_keys: bool = False) -> tuple:
        """(tile table, query starts, key starts, first query positions, tiles in the table) for tiles
        of `block` queries (or keys) out of `total`; all None without packing."""
        if not self.packed:
            return None, None, None, None, None
        table = self._tile_tables.get((block, total, over_keys))
        if table is None:
            table = tile_table(self.k_starts if over_keys else self.q_starts, block, total)
            self._tile_tables[block, total, over_keys] = table
        return table, self.q_starts, self.k_starts, self.q_pos0, table.shape[1]
