"""NSA attention layer: projections, compression, gates and RoPE around the NSA op.

The op (components.nsa) does no RoPE and no projection; this module rotates q and the
selection/window keys at their token positions and compressed key i at i*d + l - 1, exactly as
NSA_SPEC.md prescribes.
"""

from __future__ import annotations

import torch
from torch import nn

from components.models.args import TransformerArgs
from components.models.context_parallel import ContextShard
from components.models.kv_cache import LayerKV, RecentTokens
from components.models.rope import apply_rope
from components.nsa import nsa_attention, nsa_attention_at, select_blocks, select_blocks_of_last_queries
from components.nsa.compression import KVCompressor, compressed_block_positions, num_compressed_blocks
from components.nsa.documents import DocumentLayout

BRANCHES = ("cmp", "sel", "win")


class _Projected:
    """One call's projections: rotated q and sel/win keys, raw (un-rotated) keys/values for compression."""

    __slots__ = ("q", "k_raw", "v_raw", "k_sel", "v_sel", "k_win", "v_win")

    def __init__(self, **tensors: torch.Tensor):
        for name, value in tensors.items():
            setattr(self, name, value)


class NSAAttention(nn.Module):
    """Native Sparse Attention over H query heads and Hkv key/value heads (any G = H / Hkv).

    `wkv` is one fused projection whose output splits, in order, into
    (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win) with kv_per_branch, else into one (k, v) pair that
    the three branches share (compression included).
    Gates: sigmoid of `gate(x)`, 3 per query head ordered (cmp, sel, win).
    """

    def __init__(self, args: TransformerArgs):
        super().__init__()
        nsa = args.nsa
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.kv_per_branch = nsa.kv_per_branch
        self.backend = nsa.backend
        self.block_size, self.block_stride = nsa.block_size, nsa.block_stride
        # Slots no row can fill are not asked for (n = 100,000 on a short model took 400x the time, 4x the memory).
        self.selection = dict(
            block_size=nsa.block_size, block_stride=nsa.block_stride,
            sel_block_size=nsa.sel_block_size, num_selected=args.slots_used,
        )
        self.hyper = dict(self.selection, window_size=nsa.window_size)

        kv_dim = self.n_kv_heads * self.head_dim
        num_kv = 6 if self.kv_per_branch else 2
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, num_kv * kv_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.compress_k = KVCompressor(nsa.compress, nsa.block_size, nsa.block_stride, self.head_dim)
        self.compress_v = KVCompressor(nsa.compress, nsa.block_size, nsa.block_stride, self.head_dim)
        gate_out = 3 * self.n_heads
        if nsa.gate == "linear":
            self.gate = nn.Linear(args.dim, gate_out)
        else:
            hidden = max(args.dim // 4, 1)
            self.gate = nn.Sequential(nn.Linear(args.dim, hidden), nn.SiLU(), nn.Linear(hidden, gate_out))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.wq.weight, std=std)
        nn.init.normal_(self.wkv.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
        for m in self.gate.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)  # gates start near 0.5: every branch contributes
        self.compress_k.reset_parameters()
        self.compress_v.reset_parameters()

    # ---- pieces shared by training, decoding and telemetry --------------------------------
    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> _Projected:
        B, T, _ = x.shape
        q = apply_rope(self.wq(x).view(B, T, self.n_heads, self.head_dim), cos, sin, positions)
        return self._rotate_kv(q, self.wkv(x), cos, sin, positions)

    def _rotate_kv(self, q: torch.Tensor, wkv_out: torch.Tensor, cos, sin, positions: torch.Tensor) -> _Projected:
        """The projections from the fused key/value projection's output [B, T, *], keys rotated at positions."""
        B, T, _ = wkv_out.shape
        kv = wkv_out.view(B, T, -1, self.n_kv_heads, self.head_dim).unbind(2)
        if self.kv_per_branch:
            k_raw, v_raw, k_sel, v_sel, k_win, v_win = kv
            k_sel = apply_rope(k_sel, cos, sin, positions)
            k_win = apply_rope(k_win, cos, sin, positions)
        else:
            k_raw, v_raw = kv
            k_sel = k_win = apply_rope(k_raw, cos, sin, positions)
            v_sel = v_win = v_raw
        return _Projected(q=q, k_raw=k_raw, v_raw=v_raw, k_sel=k_sel, v_sel=v_sel, k_win=k_win, v_win=v_win)

    def _compressed_keys(self, k_raw: torch.Tensor, cos, sin, first_block: int = 0) -> torch.Tensor:
        """Compressed keys of the complete blocks in k_raw (the first has absolute index
        `first_block`), rotated at each block's last token."""
        k_cmp = self.compress_k(k_raw)
        num = first_block + k_cmp.shape[1]
        positions = compressed_block_positions(num, self.block_size, self.block_stride, k_cmp.device)[first_block:]
        return apply_rope(k_cmp, cos, sin, positions)

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, 3] in (0, 1), ordered (cmp, sel, win)."""
        B, T, _ = x.shape
        return torch.sigmoid(self.gate(x)).view(B, T, self.n_heads, 3)

    def _branch_inputs(self, x: torch.Tensor, cos, sin, documents: DocumentLayout | None):
        """(projections, k_cmp, v_cmp, the op's packing keywords) for x [B, T, dim]; with documents the
        B rows are one packed row [1, B*T] whose blocks and positions restart at every document."""
        if documents is None:
            p = self._project(x, cos, sin, torch.arange(x.shape[1], device=x.device))
            return p, self._compressed_keys(p.k_raw, cos, sin), self.compress_v(p.v_raw), {}
        p = self._project(x.reshape(1, -1, x.shape[-1]), cos, sin, documents.positions)
        k_cmp = apply_rope(self.compress_k(p.k_raw, documents.block_starts), cos, sin, documents.block_positions)
        return p, k_cmp, self.compress_v(p.v_raw, documents.block_starts), {"cu_seqlens": documents.cu_seqlens}

    # ---- training forward -------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: DocumentLayout | None = None, context: ContextShard | None = None) -> torch.Tensor:
        if context is not None:
            return self._context_parallel(x, cos, sin, context)
        B, T, _ = x.shape
        p, k_cmp, v_cmp, packed = self._branch_inputs(x, cos, sin, documents)
        # Every document lies within one of the B rows: T bounds their lengths (the Triton backend's layout).
        o = nsa_attention(
            p.q, k_cmp, v_cmp, p.k_sel, p.v_sel, p.k_win, p.v_win, self.gates(x).view(p.q.shape[:3] + (3,)),
            **self.hyper, backend=self.backend, **packed, max_seqlen=T,
        )
        return self.wo(o.reshape(B, T, -1))

    def _context_parallel(self, x: torch.Tensor, cos, sin, context: ContextShard) -> torch.Tensor:
        """x [B, local_len, dim] holds this rank's two chunks of every row (context_parallel.py): the
        fused key/value projection is gathered from every rank (one all-gather per layer, its backward a
        reduce-scatter), rotated and compressed over the whole rows, and each chunk's queries attend to
        the keys its ChunkKeys picks out."""
        B, Tl, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q, p, k_cmp, v_cmp = self._context_inputs(x, cos, sin, context)
        row_length = p.k_sel.shape[1] // B  # the whole rows' keys are gathered: every document lies in one row
        gates = self.gates(x).view(B, 2, Tl // 2, H, 3)
        out = []
        for half, chunk in enumerate(context.chunks):
            picked = {}  # shared keys/values are picked once

            def pick(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
                if id(t) not in picked:
                    picked[id(t)] = t.index_select(1, index)
                return picked[id(t)]

            o = nsa_attention(
                q[:, half].reshape(1, -1, H, D), pick(k_cmp, chunk.blocks), pick(v_cmp, chunk.blocks),
                pick(p.k_sel, chunk.tokens), pick(p.v_sel, chunk.tokens), pick(p.k_win, chunk.tokens),
                pick(p.v_win, chunk.tokens), gates[:, half].reshape(1, -1, H, 3), **self.hyper, backend=self.backend,
                cu_seqlens=chunk.cu_seqlens, cu_seqlens_q=chunk.cu_seqlens_q, max_seqlen=row_length,
            )
            out.append(o.view(B, Tl // 2, H, D))
        return self.wo(torch.stack(out, dim=1).reshape(B, Tl, H * D))

    def _context_inputs(self, x: torch.Tensor, cos, sin, context: ContextShard):
        """(q [B, 2, local_len / 2, H, D] of this rank's two chunks, the whole rows' projections, k_cmp,
        v_cmp) under context parallelism: the key/value projection gathered from every rank."""
        B, Tl, _ = x.shape
        H, D = self.n_heads, self.head_dim
        whole = context.layout
        q = apply_rope(self.wq(x).reshape(1, B * Tl, H, D), cos, sin, context.query_positions).view(B, 2, Tl // 2, H, D)
        wkv_out = context.shard.gather(self.wkv(x))
        p = self._rotate_kv(q, wkv_out.reshape(1, -1, wkv_out.shape[-1]), cos, sin, whole.positions)
        k_cmp = apply_rope(self.compress_k(p.k_raw, whole.block_starts), cos, sin, whole.block_positions)
        return q, p, k_cmp, self.compress_v(p.v_raw, whole.block_starts)

    @torch.no_grad()
    def gates_and_selection(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            documents: DocumentLayout | None = None,
                            context: ContextShard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For telemetry: the gates [B, T, H, 3] and the selected blocks [B, T, Hkv, n] (-1 unused, counted
        from each query's document start) that the forward on this input x uses; under context
        parallelism, of this rank's local tokens."""
        B, T, _ = x.shape
        if context is not None:
            q, _, k_cmp, _ = self._context_inputs(x, cos, sin, context)
            H, D, Hkv = self.n_heads, self.head_dim, self.n_kv_heads
            chunks = [select_blocks_of_last_queries(q[:, half].reshape(1, B * T // 2, H, D),
                                                    k_cmp.index_select(1, chunk.blocks), cu_seqlens=chunk.cu_seqlens,
                                                    cu_seqlens_q=chunk.cu_seqlens_q, num_keys=chunk.tokens.numel(),
                                                    **self.selection).view(B, T // 2, Hkv, -1)
                      for half, chunk in enumerate(context.chunks)]
            return self.gates(x), torch.stack(chunks, dim=1).view(B, T, self.n_kv_heads, -1)
        p, k_cmp, _, packed = self._branch_inputs(x, cos, sin, documents)
        return self.gates(x), select_blocks(p.q, k_cmp, **self.selection, **packed).view(B, T, self.n_kv_heads, -1)

    # ---- incremental decoding -------------------------------------------------------------
    def new_layer_cache(self, batch_size: int, capacity: int, device, dtype) -> LayerKV:
        """Full-length buffers for what selection reads (any block may be chosen) and the compressed blocks;
        recent-token streams for compression's raw keys/values (the tokens of blocks not yet emitted: fewer than
        block_size) and, with kv_per_branch, the window's keys/values (the last window_size - 1 before a step)."""
        tokens = (batch_size, capacity, self.n_kv_heads, self.head_dim)
        blocks = (batch_size, num_compressed_blocks(capacity, self.block_size, self.block_stride),
                  self.n_kv_heads, self.head_dim)

        def recent(keep: int) -> RecentTokens:
            return RecentTokens(keep, capacity, (batch_size, self.n_kv_heads, self.head_dim), device, dtype)

        # shared K/V: "k" holds the rotated keys of sel/win, "v" serves every branch (compression included)
        full = ("k_sel", "v_sel") if self.kv_per_branch else ("k", "v")
        buffers = {name: torch.zeros(tokens, device=device, dtype=dtype) for name in full}
        buffers.update({name: torch.zeros(blocks, device=device, dtype=dtype) for name in ("k_cmp", "v_cmp")})
        streams = {"k_raw": recent(self.block_size - 1)}
        if self.kv_per_branch:
            window = self.hyper["window_size"] - 1
            streams.update(v_raw=recent(self.block_size - 1), k_win=recent(window), v_win=recent(window))
        return LayerKV(buffers, streams)

    def forward_step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKV, start: int
    ) -> torch.Tensor:
        """New tokens x [B, Tn, dim] at positions start..start+Tn-1 against the cache plus themselves.

        Compressed keys/values are emitted as their blocks complete, from the cached raw keys/values.
        """
        B, Tn, _ = x.shape
        end = start + Tn
        p = self._project(x, cos, sin, torch.arange(start, end, device=x.device))
        k_raw, raw_start = cache.extend_recent(start, "k_raw", p.k_raw)
        if self.kv_per_branch:
            cache.write(start, k_sel=p.k_sel, v_sel=p.v_sel)
            k_sel, v_sel = cache.read("k_sel", end), cache.read("v_sel", end)
            v_raw, _ = cache.extend_recent(start, "v_raw", p.v_raw)
            k_win, win_start = cache.extend_recent(start, "k_win", p.k_win)
            v_win, _ = cache.extend_recent(start, "v_win", p.v_win)
        else:
            cache.write(start, k=p.k_sel, v=p.v_sel)
            k_sel = k_win = cache.read("k", end)
            v_sel = v_win = v_raw = cache.read("v", end)
            win_start = 0

        done = cache.num_compressed
        total = num_compressed_blocks(end, self.block_size, self.block_stride)
        if total > done:
            # blocks done..total-1 span tokens [done*d, (total-1)*d + l); the streams hold them from raw_start on
            lo, hi = done * self.block_stride, (total - 1) * self.block_stride + self.block_size
            v_lo = lo if v_raw is v_sel else lo - raw_start
            cache.buffers["k_cmp"][:, done:total] = self._compressed_keys(
                k_raw[:, lo - raw_start:hi - raw_start], cos, sin, first_block=done)
            cache.buffers["v_cmp"][:, done:total] = self.compress_v(v_raw[:, v_lo:v_lo + hi - lo])
            cache.num_compressed = total
        o = nsa_attention_at(
            p.q, cache.buffers["k_cmp"][:, :total], cache.buffers["v_cmp"][:, :total],
            k_sel, v_sel, k_win, v_win, self.gates(x), q_start=start, window_start=win_start, **self.hyper,
        )
        return self.wo(o.reshape(B, Tn, -1))
