"""Packed documents for dense attention: each token's RoPE position and the mask the kernel takes.

A row whose tokens are all one document needs no mask: plain causal attention (the flash kernels).
Otherwise, on CUDA, the rows get a FlexAttention BlockMask built from where documents start: a
[query block, key block] pair is skipped when the two share no document, computed without a mask
when both blocks lie inside one document, and masked token by token only where a document
boundary crosses one of them. The work is then that of the documents alone. FlexAttention is fast
only when compiled by inductor (otherwise it computes every score), and it has no CPU backward, so
blocks compiled with inductor on CUDA use it and everything else uses SDPA with an explicit
[B, 1, T, T] mask; both are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.nn.attention.flex_attention import BlockMask

from components.nsa.documents import cu_seqlens_of_rows, token_documents

FLEX_BLOCK = 128  # tokens per FlexAttention block (its default tile)


def flex_attention_runs(compile_backend: str | None, device_type: str) -> bool:
    """Whether rows of several documents take FlexAttention (else SDPA with an explicit mask): it pays
    only fused by inductor, and it has no CPU backward."""
    return compile_backend == "inductor" and device_type == "cuda"


@dataclass(frozen=True)
class DenseDocuments:
    """The forward's `documents` for a dense model, all on the rows' device. The queries are the rows'
    tokens, or (context parallelism) a subset of them: query_ids and query_rows then say which."""

    positions: torch.Tensor  # [B * Tq] int64: each query's position in its own document (for RoPE)
    document_ids: torch.Tensor  # [B, T] int64: the document each token (key) is in (rows never share one)
    one_per_row: bool  # every row is a single document (queries are whole rows): plain causal attention
    block_mask: BlockMask | None  # FlexAttention's mask (CUDA rows with several documents), else None
    query_ids: torch.Tensor | None = None  # [B, Tq] int64: each query's document, when queries are a subset
    query_rows: torch.Tensor | None = None  # [B, Tq] int64: each query's position in its row, likewise
    bias: torch.Tensor | None = None  # [B, 1, Tq, T]: explicit_mask as 0 / -inf in the compute dtype, shared by layers

    @property
    def needs_explicit_mask(self) -> bool:
        """SDPA with a mask: rows of several documents where FlexAttention does not run."""
        return not self.one_per_row and self.block_mask is None

    def with_bias(self, dtype: torch.dtype) -> DenseDocuments:
        """These documents with the explicit mask built once as SDPA's additive bias in `dtype` (the dtype
        the queries will have), for every layer of one forward to share. Each layer handing SDPA its own
        boolean mask would make it convert one and save it for backward, per layer: L x Tq x T elements
        where one copy does."""
        if not self.needs_explicit_mask or (self.bias is not None and self.bias.dtype == dtype):
            return self
        mask = self.explicit_mask()
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return replace(self, bias=bias)

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask SDPA takes for queries of `dtype`: the shared bias when it was built for that dtype,
        else the boolean mask (which SDPA converts into the same 0 / -inf bias)."""
        return self.bias if self.bias is not None and self.bias.dtype == dtype else self.explicit_mask()

    def explicit_mask(self) -> torch.Tensor:
        """[B, 1, Tq, T] bool: a key is visible when it is in the query's document and not after it."""
        keys = self.document_ids
        T = keys.shape[1]
        if self.query_ids is None:
            queries, rows = keys, torch.arange(T, device=keys.device)[None]
        else:
            queries, rows = self.query_ids, self.query_rows
        causal = torch.arange(T, device=keys.device)[None, None, :] <= rows[:, :, None]
        return ((queries[:, :, None] == keys[:, None, :]) & causal)[:, None]


def _block_tables(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, nq, nk] bool -> (per query block the count of kept key blocks [B, 1, nq], their indices first
    [B, 1, nq, nk]), int32 as BlockMask takes them."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


def _per_block(x: torch.Tensor, block: int, pad: int) -> torch.Tensor:
    """[B, N] -> [B, ceil(N / block), block], the last block padded with `pad`."""
    B, N = x.shape
    padded = torch.full((B, -(-N // block) * block), pad, dtype=x.dtype)
    padded[:, :N] = x
    return padded.view(B, -1, block)


def document_block_mask(document_ids: torch.Tensor, block: int, device: torch.device,
                        query_ids: torch.Tensor | None = None, query_rows: torch.Tensor | None = None) -> BlockMask:
    """The FlexAttention mask of rows of packed documents: document_ids [B, T] (keys), nondecreasing per
    row; the queries are the rows' tokens, or query_ids / query_rows [B, Tq] (their documents and row
    positions). Built on the host, then moved to `device`."""
    B, T = document_ids.shape
    if query_ids is None:
        query_ids, query_rows = document_ids, torch.arange(T).expand(B, T)
    Tq = query_ids.shape[1]
    big = torch.iinfo(torch.int64).max
    # Per block: the smallest and largest document and row position of its real tokens.
    q_doc, q_row = _per_block(query_ids, block, -1), _per_block(query_rows, block, -1)
    q_doc_min, q_doc_max = q_doc.masked_fill(q_doc < 0, big).amin(-1), q_doc.amax(-1)
    q_row_min, q_row_max = q_row.masked_fill(q_row < 0, big).amin(-1), q_row.amax(-1)
    k_doc = _per_block(document_ids, block, -1)
    k_doc_min, k_doc_max = k_doc.masked_fill(k_doc < 0, big).amin(-1), k_doc.amax(-1)
    k_row = torch.arange(k_doc.shape[1]) * block
    k_row_max = (k_row + block - 1).clamp(max=T - 1)
    q_whole = (q_doc_min == q_doc_max) & (q_row >= 0).all(-1)  # one document, no padding
    k_whole = (k_doc_min == k_doc_max) & (k_doc >= 0).all(-1)
    # [B, q block, k block]. Kept: some key is not after some query, and the blocks' document ranges meet
    # (a superset when a query block holds two chunks; the mask decides there). Full: every key is in
    # the one document of every query and not after any of them, so no mask is needed.
    kept = ((k_row[None, None, :] <= q_row_max[:, :, None]) & (k_doc_max[:, None, :] >= q_doc_min[:, :, None])
            & (k_doc_min[:, None, :] <= q_doc_max[:, :, None]))
    full = (q_whole[:, :, None] & k_whole[:, None, :] & (k_doc_min[:, None, :] == q_doc_min[:, :, None])
            & (k_row_max[None, None, :] <= q_row_min[:, :, None]))
    # The padded ids for the mask: padding (-1) of queries matches no key document, and vice versa.
    keys, queries, rows = (x.reshape(B, -1).to(device) for x in (k_doc, q_doc, q_row))

    def same_document_not_after(b, h, q, kv):
        return (queries[b, q] == keys[b, kv]) & (kv <= rows[b, q])

    kv_num, kv_index = _block_tables(kept & ~full)
    full_num, full_index = _block_tables(full)
    return BlockMask.from_kv_blocks(kv_num.to(device), kv_index.to(device), full_num.to(device),
                                    full_index.to(device), BLOCK_SIZE=block, mask_mod=same_document_not_after,
                                    seq_lengths=(Tq, T))


def dense_documents(document_starts: torch.Tensor, device: torch.device, *, flex: bool,
                    block: int = FLEX_BLOCK) -> DenseDocuments:
    """The rows' documents as dense attention takes them, built on the host from document_starts [B, T]
    bool (keep it there: no device sync) and put on `device`; with flex (compiled with inductor on
    CUDA, the only place it pays) also the FlexAttention mask, unless every row is one document."""
    cu = cu_seqlens_of_rows(document_starts)
    B, T = document_starts.shape
    ids, positions = token_documents(cu)
    ids = ids.view(B, T)
    one_per_row = cu.numel() - 1 == B
    device = torch.device(device)
    mask = document_block_mask(ids, block, device) if flex and not one_per_row else None
    return DenseDocuments(positions.to(device, non_blocking=True), ids.to(device, non_blocking=True), one_per_row,
                          mask)
