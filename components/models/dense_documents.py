"""Packed documents for dense attention: each token's RoPE position and the mask the kernel takes.

A row whose tokens are all one document needs no mask: plain causal attention (the flash kernels).
Otherwise, on CUDA, the rows get a FlexAttention BlockMask built from where documents start: a
[query block, key block] pair is skipped when the two share no document, computed without a mask
when both blocks lie inside one document, and masked token by token only where a document
boundary crosses one of them. The work is then that of the documents alone. FlexAttention is fast
only when compiled (eager, it computes every score), and it has no CPU backward, so compiled
blocks on CUDA use it and everything else uses SDPA with an explicit [B, 1, T, T] mask; both are
exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from components.nsa.documents import cu_seqlens_of_rows

FLEX_BLOCK = 128  # tokens per FlexAttention block (its default tile)


@dataclass(frozen=True)
class DenseDocuments:
    """The forward's `documents` for a dense model, all on the rows' device."""

    positions: torch.Tensor  # [B * T] int64: each token's position in its own document (for RoPE)
    document_ids: torch.Tensor  # [B, T] int64: the document each token is in (rows never share one)
    one_per_row: bool  # every row is a single document: plain causal attention
    block_mask: BlockMask | None  # FlexAttention's mask (CUDA rows with several documents), else None

    def explicit_mask(self) -> torch.Tensor:
        """[B, 1, T, T] bool: a key is visible when it is in the query's document and not after it."""
        ids = self.document_ids
        T = ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


def _block_tables(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, nq, nk] bool -> (per query block the count of kept key blocks [B, 1, nq], their indices first
    [B, 1, nq, nk]), int32 as BlockMask takes them."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


def document_block_mask(document_ids: torch.Tensor, block: int, device: torch.device) -> BlockMask:
    """The FlexAttention mask of rows of packed documents, document_ids [B, T] nondecreasing per row (on
    the host; the block tables are built there, then moved to `device`)."""
    B, T = document_ids.shape
    nb = -(-T // block)
    last_token = T - 1
    starts = torch.arange(nb) * block
    first = document_ids[:, starts]  # [B, nb]: the document of each block's first and last real token
    last = document_ids[:, (starts + block - 1).clamp(max=last_token)]
    index = torch.arange(nb)
    causal = index[None, :] <= index[:, None]  # [q block, k block]
    # Documents run in order along a row, so a key block can share a document with a query block at or
    # after it exactly when the key block's last document is not before the query block's first.
    touching = causal & (last[:, None, :] >= first[:, :, None])
    whole = (first == last) & (starts + block <= T)  # one document and no padding
    # Every visible key of an earlier block in the query block's own (single) document: no mask needed.
    full = (index[None, :] < index[:, None]) & whole[:, None, :] & whole[:, :, None] & (
        first[:, None, :] == first[:, :, None])
    partial = touching & ~full
    padded = torch.full((B, nb * block), -1, dtype=document_ids.dtype)  # padding matches no document
    padded[:, :T] = document_ids
    ids = padded.to(device)

    def same_document_causal(b, h, q, kv):
        return (ids[b, q] == ids[b, kv]) & (kv <= q)

    kv_num, kv_index = _block_tables(partial)
    full_num, full_index = _block_tables(full)
    return BlockMask.from_kv_blocks(kv_num.to(device), kv_index.to(device), full_num.to(device),
                                    full_index.to(device), BLOCK_SIZE=block, mask_mod=same_document_causal,
                                    seq_lengths=(T, T))


def dense_documents(document_starts: torch.Tensor, device: torch.device, block: int = FLEX_BLOCK) -> DenseDocuments:
    """The rows' documents as dense attention takes them, built on the host from document_starts [B, T]
    bool (keep it there: no device sync) and put on `device`. The FlexAttention mask is built for CUDA
    devices only (the only place it runs)."""
    cu = cu_seqlens_of_rows(document_starts)
    B, T = document_starts.shape
    lengths = cu.diff()
    positions = torch.arange(B * T) - cu[:-1].repeat_interleave(lengths)
    ids = torch.arange(lengths.numel()).repeat_interleave(lengths).view(B, T)
    one_per_row = lengths.numel() == B
    device = torch.device(device)
    mask = None if one_per_row or device.type != "cuda" else document_block_mask(ids, block, device)
    return DenseDocuments(positions.to(device, non_blocking=True), ids.to(device, non_blocking=True), one_per_row,
                          mask)
