"""Dense causal attention (SDPA) with grouped-query heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from components.models.args import TransformerArgs
from components.models.context_parallel import ContextShard
from components.models.dense_documents import DenseDocuments
from components.models.kv_cache import LayerKV
from components.models.rope import apply_rope


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, Tq, H, D], k/v [B, Tk, Hkv, D] -> [B, Tq, H, D]; causal when mask is None (Tq == Tk)."""
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, enable_gqa=gqa,
    )
    return out.transpose(1, 2)


class DenseAttention(nn.Module):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)

    def _qkv(self, x, cos, sin, positions):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin, positions), apply_rope(k, cos, sin, positions), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: DenseDocuments | None = None, context: ContextShard | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        if context is not None:
            # The baseline's context parallelism: every rank gathers all keys and values (one
            # all-gather per layer) and attends its queries to them, masked by document and position.
            q, k, v = self._qkv(x.reshape(1, B * T, -1), cos, sin, context.query_positions)
            kv = context.shard.gather(torch.cat([k, v], dim=2).view(B, T, 2 * self.n_kv_heads, self.head_dim))
            k, v = kv.split(self.n_kv_heads, dim=2)
            o = self._attend(q.view(B, T, self.n_heads, self.head_dim), k, v, context.dense)
            return self.wo(o.reshape(B, T, -1))
        if documents is None or documents.one_per_row:
            q, k, v = self._qkv(x, cos, sin, torch.arange(T, device=x.device))
            return self.wo(_sdpa(q, k, v, mask=None).reshape(B, T, -1))
        q, k, v = (t.reshape(B, T, *t.shape[2:]) for t in self._qkv(x.reshape(1, B * T, -1), cos, sin,
                                                                     documents.positions))
        return self.wo(self._attend(q, k, v, documents).reshape(B, T, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DenseDocuments) -> torch.Tensor:
        """q [B, Tq, H, D] against k/v [B, T, Hkv, D] within documents -> [B, Tq, H, D]."""
        if documents.block_mask is not None and torch.compiler.is_compiling():
            # Compiled on CUDA: FlexAttention skips the key blocks of other documents (dense_documents.py).
            o = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               block_mask=documents.block_mask, enable_gqa=self.n_heads != self.n_kv_heads)
            return o.transpose(1, 2)
        # Eager, or on the CPU: an explicit [B, 1, Tq, T] mask (exact, O(Tq x T) elements, built once per forward).
        return _sdpa(q, k, v, mask=documents.attention_mask(q.dtype))

    # ---- incremental decoding -------------------------------------------------------------
    def new_layer_cache(self, batch_size: int, capacity: int, device, dtype) -> LayerKV:
        shape = (batch_size, capacity, self.n_kv_heads, self.head_dim)
        return LayerKV({name: torch.zeros(shape, device=device, dtype=dtype) for name in ("k", "v")})

    def forward_step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKV, start: int
    ) -> torch.Tensor:
        """New tokens x [B, Tn, dim] at positions start.. against the cached keys plus their own."""
        B, Tn, _ = x.shape
        end = start + Tn
        positions = torch.arange(start, end, device=x.device)
        q, k, v = self._qkv(x, cos, sin, positions)
        cache.write(start, k=k, v=v)
        # is_causal aligns the mask to the top-left corner, wrong once Tq != Tk: spell it out.
        keys = torch.arange(end, device=x.device)
        mask = keys[None, :] <= positions[:, None]
        o = _sdpa(q, cache.read("k", end), cache.read("v", end), mask=mask)
        return self.wo(o.reshape(B, Tn, -1))
