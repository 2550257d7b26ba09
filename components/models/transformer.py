"""Decoder-only transformer language model with NSA or dense attention.

Everything outside the attention module is identical for both kinds. Built for the engine:
`tok_embeddings`, `layers` (one module per block, to compile / shard / checkpoint each),
`norm`, `output`; constructible on the meta device, then `to_empty` + `init_weights`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from components.errors import UserError
from components.models.args import TransformerArgs
from components.models.context_parallel import ContextShard, context_shard
from components.models.dense_attention import DenseAttention
from components.models.dense_documents import DenseDocuments, dense_documents, flex_attention_runs
from components.models.kv_cache import KVCache, LayerKV
from components.models.mlp import SwiGLU
from components.models.norms import RMSNorm
from components.models.output_head import OutputHead
from components.models.nsa_attention import NSAAttention
from components.models.rope import RotaryEmbedding
from components.nsa.documents import DocumentLayout, rows_layout
from components.problems import find_problems, problem, raise_problems
from components.sequence_shard import SequenceShard


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = NSAAttention(args) if args.attention == "nsa" else DenseAttention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = SwiGLU(args.dim, args.mlp_hidden_dim())

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: DocumentLayout | DenseDocuments | None = None,
                context: ContextShard | None = None) -> torch.Tensor:
        x = x + (self.attention(self.attention_norm(x), cos, sin, documents) if context is None else
                 self.attention(self.attention_norm(x), cos, sin, context=context))
        return x + self.feed_forward(self.ffn_norm(x))

    def forward_step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKV, start: int
    ) -> torch.Tensor:
        x = x + self.attention.forward_step(self.attention_norm(x), cos, sin, cache, start)
        return x + self.feed_forward(self.ffn_norm(x))


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the attention's queries will have: autocast's, else the activations' own."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


class Transformer(nn.Module):
    def __init__(self, args: TransformerArgs, vocab_size: int):
        super().__init__()
        self.args, self.vocab_size = args, vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = OutputHead(args.dim, vocab_size)
        # Dense attention masks documents through FlexAttention where flex_attention_runs says (the
        # `compiled` hook tells the blocks' backend); otherwise through an explicit mask.
        self.compile_backend: str | None = None
        self._tie()
        if not self.norm.weight.is_meta:
            self.init_weights()

    def _tie(self) -> None:
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def get_output_embeddings(self) -> nn.Linear:
        """The layer that maps to the vocabulary (the name transformers models use): optimizers treat it
        as a table, not a hidden matrix."""
        return self.output

    def to_empty(self, *, device, recurse: bool = True):
        # Materialising may give tied modules separate storage; share the weight again.
        super().to_empty(device=device, recurse=recurse)
        self._tie()
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Full deterministic init from the global torch RNG (same seed -> same weights).

        normal(0, init_std) for embeddings and projections; the projections that write into the
        residual stream (attention wo, MLP w2) use init_std / sqrt(2 * n_layers) so the stream's
        variance does not grow with depth; norms start at one; RoPE tables are recomputed.
        """
        self._tie()
        std = self.args.init_std
        out_std = std / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        self.rope.reset_parameters()
        for layer in self.layers:
            layer.init_weights(std, out_std)
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (a tied weight counts once); optionally without the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def _check_length(self, end: int) -> None:
        if end > self.args.max_seq_len:
            raise UserError(
                f"sequence length {end} exceeds max_seq_len {self.args.max_seq_len}; "
                f"raise model max_seq_len or use shorter sequences"
            )

    def forward(self, tokens: torch.Tensor, documents: DocumentLayout | DenseDocuments | torch.Tensor | None = None,
                context: ContextShard | None = None) -> torch.Tensor:
        """tokens [B, T] long -> logits [B, T, vocab_size].

        documents: where documents start in the rows, as document_starts [B, T] bool (True where a
        token opens a document; each row's first token always does; the data loader's batches carry
        it) or as the layout `document_layout(document_starts, device)` builds from it. Every document
        is then attended on its own, its positions counted from its start, as if it were run alone
        (NSA_SPEC.md section 4).

        context (context parallelism, from `context_shard`): tokens [B, local_len] are this rank's share
        of every row, and the layers gather the rest; the logits are those of the same tokens in the
        whole rows' forward. It carries the documents itself.
        """
        if context is not None:
            return self._forward_shard(tokens, context)
        self._check_length(tokens.shape[1])
        if isinstance(documents, torch.Tensor):
            documents = self.document_layout(documents, tokens.device)
        if documents is not None and documents.positions.shape[0] != tokens.numel():
            raise ValueError(f"the document layout covers {documents.positions.shape[0]} tokens but the batch "
                             f"{tuple(tokens.shape)} has {tokens.numel()}; build it from this batch's document_starts")
        h = self.tok_embeddings(tokens)
        if isinstance(documents, DenseDocuments):
            documents = documents.with_bias(_compute_dtype(h))
        for layer in self.layers:
            # Blocks are called without the argument when there is none: plugin blocks need not take it.
            h = layer(h, self.rope.cos, self.rope.sin) if documents is None else \
                layer(h, self.rope.cos, self.rope.sin, documents)
        return self.output(self.norm(h))

    def _forward_shard(self, tokens: torch.Tensor, context: ContextShard) -> torch.Tensor:
        self._check_length(context.shard.seq_len)
        if tokens.shape[1] != context.shard.local_len or context.query_positions.shape[0] != tokens.numel():
            raise ValueError(f"tokens {tuple(tokens.shape)} are not the share of the rows this context was built for "
                             f"({context.query_positions.shape[0]} tokens, {context.shard.local_len} per row)")
        h = self.tok_embeddings(tokens)
        if context.dense is not None:
            context = replace(context, dense=context.dense.with_bias(_compute_dtype(h)))
        for layer in self.layers:
            h = layer(h, self.rope.cos, self.rope.sin, context=context)
        return self.output(self.norm(h))

    def context_shard(self, document_starts: torch.Tensor | None, rows: int, shard: SequenceShard,
                      device: torch.device) -> ContextShard:
        """The forward's `context` for this rank's share of `rows` rows (document_starts [B, T] bool on the
        host, or None: each row one document; ignored unless the model masks documents)."""
        if self.args.attention == "nsa":
            from components.nsa.backends import get_backend

            if not get_backend(self.args.nsa.backend).takes_query_offsets:
                raise UserError(f"context parallelism runs each rank's queries against gathered keys, which NSA "
                                f"backend {self.args.nsa.backend!r} does not support (no cu_seqlens_q). Fix: set "
                                f"model.nsa.backend = 'reference', or parallelism.context_parallel_degree = 1.")
        nsa = self.args.nsa
        return context_shard(document_starts if self.args.document_masking else None, rows, shard,
                             block_size=nsa.block_size, block_stride=nsa.block_stride,
                             dense=self.args.attention != "nsa", flex=self._flex_on(device), device=device)

    def _flex_on(self, device) -> bool:
        return flex_attention_runs(self.compile_backend, torch.device(device).type)

    def document_layout(self, document_starts: torch.Tensor,
                        device: torch.device) -> DocumentLayout | DenseDocuments:
        """The rows' documents as the attention layers take them, built on the host (keep
        document_starts there: no device sync) and put on `device`. NSA's counts (documents, compressed
        blocks) change from batch to batch, so they are marked dynamic: compiled blocks take any
        boundaries without recompiling. Dense attention's tensors have the batch's shape."""
        if self.args.attention != "nsa":
            return dense_documents(document_starts, device, flex=self._flex_on(device))
        nsa = self.args.nsa
        layout = rows_layout(document_starts, nsa.block_size, nsa.block_stride, device)
        for varying in (layout.cu_seqlens, layout.block_starts, layout.block_positions):
            torch._dynamo.maybe_mark_dynamic(varying, 0)
        return layout

    # ---- incremental decoding -------------------------------------------------------------
    def new_kv_cache(self, batch_size: int, capacity: int | None = None) -> KVCache:
        """An empty cache for up to `capacity` tokens (default max_seq_len), on the model's device/dtype."""
        capacity = self.args.max_seq_len if capacity is None else capacity
        if not 1 <= capacity <= self.args.max_seq_len:
            raise UserError(f"KV-cache capacity {capacity} must be in 1..max_seq_len ({self.args.max_seq_len}); "
                            f"lower it or raise max_seq_len")
        ref = self.norm.weight
        layers = [layer.attention.new_layer_cache(batch_size, capacity, ref.device, ref.dtype) for layer in self.layers]
        return KVCache(layers, batch_size, capacity)

    @torch.no_grad()
    def forward_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append tokens [B, Tnew] to the cache and return their logits [B, Tnew, vocab_size].

        Inference only (no autograd). Equals `forward` on the whole sequence so far, at the new positions.
        """
        B, Tn = tokens.shape
        start = cache.length
        if B != cache.batch_size:
            raise UserError(f"batch size {B} does not match the cache's {cache.batch_size}; make a new cache")
        if start + Tn > cache.capacity:
            raise UserError(f"{start + Tn} tokens exceed the cache capacity {cache.capacity}; "
                            f"make the cache larger (new_kv_cache(capacity=...))")
        h = self.tok_embeddings(tokens)
        saved = cache.state()
        try:
            for layer, layer_cache in zip(self.layers, cache.layers):
                h = layer.forward_step(h, self.rope.cos, self.rope.sin, layer_cache, start)
        except BaseException:  # out of memory, say, after some layers took the tokens: as if the step never ran
            cache.rewind(saved)
            raise
        cache.length = start + Tn
        return self.output(self.norm(h))


def build_transformer(args: TransformerArgs, vocab_size: int) -> Transformer:
    """Check the arguments (UserError listing every problem), then build on the current device."""
    problems = find_problems(args)
    if vocab_size < 1:
        problems.append(problem("vocab_size", vocab_size, "must be at least 1", "check the tokenizer"))
    raise_problems("invalid model arguments", problems)
    return Transformer(args, vocab_size)
