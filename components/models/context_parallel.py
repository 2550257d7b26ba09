"""What a rank's attention layers need under context parallelism, built once per batch on the host.

The rank holds two chunks of every row (components/sequence_shard.py). Its queries in one chunk see
keys from the start of their document up to the chunk's end, all of it gathered from the other
ranks. Each chunk becomes one call of the NSA op in its query-offset form (cu_seqlens_q): a "key
document" per document the chunk touches, holding that document's tokens from its start to the
chunk's end (a prefix of it: its compressed blocks are the first blocks of the whole document's),
with the chunk's queries as its last ones. Key tokens and blocks are picked out of the gathered
rows by index, so the sizes vary from batch to batch without recompiling (they are marked dynamic).
The two chunks run as two calls so that no key is picked twice in one call: the backward of the
pick then adds one gradient per key, the same sums in the same order every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.models.dense_documents import FLEX_BLOCK, DenseDocuments, document_block_mask
from components.nsa.documents import DocumentLayout, compressed_counts, rows_layout, token_documents, written_once
from components.sequence_shard import SequenceShard


@dataclass(frozen=True)
class ChunkKeys:
    """One chunk of every row as one op call, indexing the gathered rows read as one packed row."""

    tokens: torch.Tensor  # int64 [Nk]: the key documents' tokens
    blocks: torch.Tensor  # int64 [Nc]: their compressed blocks in the whole rows' packed k_cmp
    cu_seqlens: torch.Tensor  # int64 [N + 1]: key documents
    cu_seqlens_q: torch.Tensor  # int64 [N + 1]: their queries (each the document's last ones)


@dataclass(frozen=True)
class ContextShard:
    """The forward's `context=` argument: this rank's share of a batch of B rows."""

    shard: SequenceShard
    layout: DocumentLayout  # the whole rows read as one packed row (one document per row without masking)
    query_positions: torch.Tensor  # int64 [B * local_len]: each local token's position in its document
    chunks: tuple[ChunkKeys, ChunkKeys]
    dense: DenseDocuments | None  # for dense attention: the local queries' documents against the whole rows


def _chunk_keys(cu: torch.Tensor, first_block: torch.Tensor, rows: int, seq_len: int, start: int, end: int,
                block_size: int, block_stride: int) -> ChunkKeys:
    """The key documents of chunk [start, end) of every row (cu: the whole rows' document starts)."""
    docs, key_start, key_end, query_start = [], [], [], []
    for row in range(rows):
        lo, hi = row * seq_len + start, row * seq_len + end
        first = int(torch.searchsorted(cu, lo, right=True)) - 1
        last = int(torch.searchsorted(cu, hi)) - 1  # the last document starting before hi
        ids = torch.arange(first, last + 1)
        docs.append(ids)
        key_start.append(cu[ids])
        key_end.append(cu[ids + 1].clamp(max=hi))
        query_start.append(cu[ids].clamp(min=lo))
    docs, key_start, key_end, query_start = (torch.cat(x) for x in (docs, key_start, key_end, query_start))
    key_len, query_len = key_end - key_start, key_end - query_start
    offsets = torch.cumsum(key_len, 0) - key_len
    tokens = (key_start.repeat_interleave(key_len) + torch.arange(int(key_len.sum()))
              - offsets.repeat_interleave(key_len))
    blocks_per_doc = compressed_counts(key_len, block_size, block_stride)
    block_offsets = torch.cumsum(blocks_per_doc, 0) - blocks_per_doc
    blocks = (first_block[docs].repeat_interleave(blocks_per_doc) + torch.arange(int(blocks_per_doc.sum()))
              - block_offsets.repeat_interleave(blocks_per_doc))
    zero = torch.zeros(1, dtype=torch.int64)
    return ChunkKeys(tokens, blocks, torch.cat([zero, key_len.cumsum(0)]), torch.cat([zero, query_len.cumsum(0)]))


def context_shard(document_starts: torch.Tensor | None, rows: int, shard: SequenceShard, *, block_size: int,
                  block_stride: int, dense: bool, device: torch.device, flex: bool = False) -> ContextShard:
    """This rank's ContextShard for B = rows rows of shard.seq_len tokens. document_starts [B, T] bool
    (host) marks where documents start; None: every row is one document. flex: dense attention runs
    FlexAttention (build its block mask)."""
    T = shard.seq_len
    if document_starts is None:
        document_starts = torch.zeros(rows, T, dtype=torch.bool)
    if tuple(document_starts.shape) != (rows, T):
        raise ValueError(f"document_starts has shape {tuple(document_starts.shape)}, but the rows are {(rows, T)}")
    layout = rows_layout(document_starts, block_size, block_stride, torch.device("cpu"))
    cu = layout.cu_seqlens
    blocks = compressed_counts(cu.diff(), block_size, block_stride)
    first_block = torch.cumsum(blocks, 0) - blocks
    chunks = tuple(_chunk_keys(cu, first_block, rows, T, a, b, block_size, block_stride) for a, b in shard.chunks())
    local = shard.positions()
    query_positions = layout.positions.view(rows, T)[:, local].reshape(-1)

    def put(x: torch.Tensor, varying: bool = True) -> torch.Tensor:
        x = x.to(device, non_blocking=True)
        if varying:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        return x

    query_positions = put(query_positions, False)
    dense_documents = None
    if dense:
        doc = token_documents(cu)[0].view(rows, T)
        query_ids, query_rows = doc[:, local], local.expand(rows, -1)
        block_mask = document_block_mask(doc, FLEX_BLOCK, device, query_ids, query_rows) if flex else None
        dense_documents = DenseDocuments(query_positions, put(doc, False), False, block_mask,
                                         put(query_ids, False), put(query_rows, False))

    chunks = tuple(ChunkKeys(*(put(x) for x in (c.tokens, c.blocks, c.cu_seqlens, c.cu_seqlens_q))) for c in chunks)
    layout = DocumentLayout(put(cu), put(layout.positions, False), put(layout.block_starts),
                            put(layout.block_positions))
    written_once(layout.cu_seqlens, *(x for c in chunks for x in (c.cu_seqlens, c.cu_seqlens_q)))
    return ContextShard(shard=shard, layout=layout, query_positions=query_positions, chunks=chunks,
                        dense=dense_documents)
