"""Exact softmax attention under an arbitrary visibility rule, a chunk of queries at a time.

Memory stays bounded in both passes: the forward keeps only its inputs and output, and the
backward recomputes each chunk's probabilities (the flash-attention backward, written in plain
PyTorch). A chunk only touches the keys its rule's key_range allows.

Layout inside: q [B, Hkv, Tq, G, D] (already multiplied by the softmax scale), k and v
[B, Hkv, Tk, D]; all in one floating dtype (fp32, or fp64 for gradcheck). A row that sees no key
gets output 0 and gradient 0.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

# Query rows per chunk: 64 measured fastest on CPU (larger chunks fall out of cache), and it
# bounds memory at any length. MAX_CHUNK_ELEMENTS caps one chunk's score matrix
# [B, Hkv, C, G, K] (2**23 fp32 = 32 MiB) for large batches and long contexts.
CHUNK_ROWS = 64
MAX_CHUNK_ELEMENTS = 2**23


def query_chunk_size(batch: int, heads: int, key_span: int, num_queries: int) -> int:
    """Queries per chunk: CHUNK_ROWS, fewer when one chunk's scores would pass MAX_CHUNK_ELEMENTS."""
    per_query = max(1, batch * heads * key_span)
    return max(1, min(num_queries, CHUNK_ROWS, max(8, MAX_CHUNK_ELEMENTS // per_query)))


def query_layout(q: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, Tq, H, D] -> contiguous [B, Hkv, Tq, G, D] in `dtype`, times the softmax scale 1/sqrt(D).

    Query head h belongs to key/value group h // G.
    """
    B, Tq, H, D = q.shape
    q5 = q.reshape(B, Tq, num_kv_heads, H // num_kv_heads, D).to(dtype) * (D**-0.5)
    return q5.permute(0, 2, 1, 3, 4).contiguous()


def key_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Tk, Hkv, D] -> contiguous [B, Hkv, Tk, D] in `dtype`."""
    return x.to(dtype).permute(0, 2, 1, 3).contiguous()


def _chunks(num_queries: int, chunk: int):
    for c0 in range(0, num_queries, chunk):
        yield c0, min(num_queries, c0 + chunk)


def chunk_probabilities(q, k, rule, p0: int, p1: int, c0: int, c1: int, k0: int, k1: int) -> torch.Tensor:
    """Softmax over the visible keys [B, Hkv, C, G, K] for query rows c0:c1 (positions p0:p1)."""
    B, Hkv, _, G, D = q.shape
    C, K = c1 - c0, k1 - k0
    scores = torch.matmul(q[:, :, c0:c1].reshape(B, Hkv, C * G, D), k[:, :, k0:k1].transpose(-1, -2))
    scores = rule.mask_(scores.view(B, Hkv, C, G, K), p0, p1, k0, k1)
    probs = torch.softmax(scores, dim=-1)
    blind = min(C, rule.first_seeing - p0)
    if blind > 0:
        probs[:, :, :blind] = 0.0  # rows that see no key: softmax gave 0/0, the spec says 0
    return probs


def chunked_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule, q_start: int,
                              chunk: int) -> torch.Tensor:
    """The forward alone, no autograd: out [B, Hkv, Tq, G, Dv]."""
    B, Hkv, Tq, G, D = q.shape
    Dv = v.shape[-1]
    out = q.new_zeros(B, Hkv, Tq, G, Dv)
    for c0, c1 in _chunks(Tq, chunk):
        p0, p1 = q_start + c0, q_start + c1
        k0, k1 = rule.key_range(p0, p1)
        if k1 <= k0:
            continue  # nobody in this chunk sees a key: output 0
        probs = chunk_probabilities(q, k, rule, p0, p1, c0, c1, k0, k1)
        C, K = c1 - c0, k1 - k0
        out[:, :, c0:c1] = torch.matmul(probs.view(B, Hkv, C * G, K), v[:, :, k0:k1]).view(B, Hkv, C, G, Dv)
    return out


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rule, q_start: int, chunk: int):
        out = chunked_attention_forward(q, k, v, rule, q_start, chunk)
        ctx.save_for_backward(q, k, v, out)
        ctx.rule, ctx.q_start, ctx.chunk = rule, q_start, chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = chunked_attention_backward(q, k, v, out, grad_out, ctx.rule, ctx.q_start, ctx.chunk)
        return dq, dk, dv, None, None, None


def chunked_attention_backward(q, k, v, out, grad_out, rule, q_start: int, chunk: int):
    """(dq, dk, dv) of chunked attention, recomputing each chunk's probabilities (flash-style)."""
    B, Hkv, Tq, G, D = q.shape
    Dv = v.shape[-1]
    grad_out = grad_out.to(out.dtype)
    delta = (grad_out * out).sum(dim=-1)  # [B, Hkv, Tq, G]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for c0, c1 in _chunks(Tq, chunk):
        p0, p1 = q_start + c0, q_start + c1
        k0, k1 = rule.key_range(p0, p1)
        if k1 <= k0:
            continue
        C, K = c1 - c0, k1 - k0
        probs = chunk_probabilities(q, k, rule, p0, p1, c0, c1, k0, k1).view(B, Hkv, C * G, K)
        qc = q[:, :, c0:c1].reshape(B, Hkv, C * G, D)
        kc, vc = k[:, :, k0:k1], v[:, :, k0:k1]
        go = grad_out[:, :, c0:c1].reshape(B, Hkv, C * G, Dv)
        dv[:, :, k0:k1] += torch.matmul(probs.transpose(-1, -2), go)
        dscores = torch.matmul(go, vc.transpose(-1, -2))
        dscores.sub_(delta[:, :, c0:c1].reshape(B, Hkv, C * G, 1)).mul_(probs)
        dq[:, :, c0:c1] = torch.matmul(dscores, kc).view(B, Hkv, C, G, D)
        dk[:, :, k0:k1] += torch.matmul(dscores.transpose(-1, -2), qc)
    return dq, dk, dv


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule, q_start: int,
                      chunk: int) -> torch.Tensor:
    """softmax(q k^T, hidden keys excluded) v per row; q pre-scaled, layout as in the module doc."""
    return _ChunkedAttention.apply(q, k, v, rule, q_start, chunk)
