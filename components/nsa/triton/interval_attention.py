"""Flash attention where each query sees one contiguous run of keys: the compressed and window branches.

Key i stands at position kpos(i) = i * key_stride + key_offset; query t sees key i iff
    t - window < kpos(i) <= t.
Compressed branch: key_stride = d, key_offset = l - 1 (a block's last token), unbounded window.
Window branch: key_stride = 1, key_offset = 0, window = w.

Layouts: q/o/dq [B, T, H, D]; k/v/dk/dv [B, NK, Hkv, D] (last dim dense, other strides free);
lse2/delta [B, H, T] fp32. lse2 is the base-2 logsumexp of the scaled logits, +inf for a query
that sees no key (so exp2(s - lse2) is 0 there without a NaN anywhere); such a query gets o = 0.
Offsets are formed in int64 so that B*T*H*D beyond 2**31 elements cannot overflow.

Masked (chosen, selection_mask.py): the selected branch's masked layout, key_stride 1 and an unbounded
window (causal), each key tile lying inside one selection block and hidden from the queries whose KV
group did not select that block.

Packed documents (cu_seqlens, B = 1): positions count from each document's start and a document's
keys follow one another in k/v (its compressed blocks, or its tokens); programs take tiles of one
document (packing.py), so each document is computed exactly as on its own. With query offsets
(cu_seqlens_q) a document's queries are its last ones: query i of it stands at position pos0 + i.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.nsa.triton import tile_configs
from components.nsa.triton.launch import LOG2E, dot_precision, flat_grid
from components.nsa.triton.tile_configs import cdiv, head_block
from components.nsa.triton.packing import DocumentTables
from components.nsa.triton.selection_mask import Chosen
from components.nsa.triton.softmax_delta import softmax_delta
from components.nsa.triton.tiles import (document_tile, load_rows, online_softmax_step, softmax_grads,
                                        softmax_grads_by_key, softmax_result)


@triton.jit
def _visible(offs_m, offs_n, KEY_STRIDE, KEY_OFFSET, WINDOW):
    """[queries, keys] mask: key n sits at KEY_OFFSET + n * KEY_STRIDE and is seen by the queries
    at or after it, up to WINDOW - 1 positions later."""
    kpos = offs_n * KEY_STRIDE + KEY_OFFSET
    return (kpos[None, :] <= offs_m[:, None]) & (kpos[None, :] > offs_m[:, None] - WINDOW)


@triton.jit
def _seen_by_keys(offs_n, offs_m, KEY_STRIDE, KEY_OFFSET, WINDOW):
    """_visible laid out [keys, queries]."""
    kpos = offs_n * KEY_STRIDE + KEY_OFFSET
    return (kpos[:, None] <= offs_m[None, :]) & (kpos[:, None] > offs_m[None, :] - WINDOW)


@triton.jit
def _visible_key_range(t_first, BLOCK_M, T, NK, KEY_STRIDE, KEY_OFFSET, WINDOW):
    """[n_lo, n_hi): the keys any query of the tile t_first .. t_first + BLOCK_M - 1 can see, i.e.
    kpos in (t_first - WINDOW, t_last]. max(.., 0) keeps every division non-negative (Triton's
    integer division truncates toward zero)."""
    t_last = tl.minimum(t_first + BLOCK_M, T) - 1
    n_hi = tl.minimum(NK, tl.maximum(t_last - KEY_OFFSET + KEY_STRIDE, 0) // KEY_STRIDE)
    n_lo = tl.maximum(t_first - WINDOW - KEY_OFFSET + KEY_STRIDE, 0) // KEY_STRIDE
    return n_lo, n_hi


@triton.jit
def _selections(CHOSEN, b, hk, rows, rows_ok, scb, sct, sch, NUM_SEL, BLOCK_S: tl.constexpr):
    """[rows, BLOCK_S] int16 or int32: the key blocks (counted from the document start) that the queries at
    these rows of batch row b chose for KV group hk; -1 in unused and padding slots (selection_mask.Chosen)."""
    slots = tl.arange(0, BLOCK_S)
    at = CHOSEN + b * scb + rows.to(tl.int64)[:, None] * sct + hk * sch + slots[None, :]
    return tl.load(at, mask=rows_ok[:, None] & (slots < NUM_SEL)[None, :], other=-1)


@triton.jit
def _chose(selections, block):
    """[rows] bool: whether each row's selections hold key block `block`."""
    return tl.max((selections == block).to(tl.int32), 1) > 0


@triton.jit
def _interval_attn_fwd_kernel(
    Q, K, V, O, LSE2, TILES, Q_STARTS, K_STARTS, Q_POS0, CHOSEN, scb, sct, sch, SEL_BLOCK, NUM_SEL,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
    T, NK, H, G, NUM_TILES, KEY_STRIDE, KEY_OFFSET, WINDOW, qk_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PACKED: tl.constexpr, SELECTED: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Positions below are within the tile's document: q0 / k0 rows into the row's queries / keys.
    tile, pid_bh, q0, num_q, k0, num_k, pos0 = document_tile(TILES, Q_STARTS, K_STARTS, Q_POS0, NUM_TILES,
                                                             tl.cdiv(T, BLOCK_M), T, NK, PACKED)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // G).to(tl.int64)
    h64 = h.to(tl.int64)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < num_q
    d_ok = offs_d < D
    row_mask = m_ok[:, None] & d_ok[None, :]
    rows = offs_m.to(tl.int64)
    q = load_rows(Q + b * sqb + h64 * sqh + q0 * sqt, rows, sqt, offs_d, row_mask)

    # Query i of the tile's document stands at position pos0 + i.
    n_lo, n_hi = _visible_key_range(tile * BLOCK_M + pos0, BLOCK_M, num_q + pos0, num_k, KEY_STRIDE, KEY_OFFSET,
                                    WINDOW)

    if SELECTED:
        picks = _selections(CHOSEN, b, hk, q0 + offs_m, m_ok, scb, sct, sch, NUM_SEL, BLOCK_S)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + hk * skh + k0 * skt
    v_base = V + b * svb + hk * svh + k0 * svt
    for start in range(n_lo, n_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = load_rows(k_base, offs_n.to(tl.int64), skt, offs_d, kv_mask)
        v = load_rows(v_base, offs_n.to(tl.int64), svt, offs_d, kv_mask)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        seen = _visible(offs_m + pos0, offs_n, KEY_STRIDE, KEY_OFFSET, WINDOW) & n_ok[None, :]
        if SELECTED:
            seen &= _chose(picks, start // SEL_BLOCK)[:, None]
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, tl.where(seen, s, float("-inf")), v, PRECISION)

    o, lse2 = softmax_result(m_i, l_i, acc)
    tl.store(O + b * sob + h64 * soh + (q0 + rows)[:, None] * sot + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_mask)
    tl.store(LSE2 + (b * H + h64) * T + q0 + offs_m, lse2, mask=m_ok)


@triton.jit
def _interval_attn_bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ, TILES, Q_STARTS, K_STARTS, Q_POS0, CHOSEN, scb, sct, sch, SEL_BLOCK, NUM_SEL,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh, sdqb, sdqt, sdqh,
    T, NK, H, G, NUM_TILES, KEY_STRIDE, KEY_OFFSET, WINDOW, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PACKED: tl.constexpr, SELECTED: tl.constexpr, BLOCK_S: tl.constexpr,
):
    tile, pid_bh, q0, num_q, k0, num_k, pos0 = document_tile(TILES, Q_STARTS, K_STARTS, Q_POS0, NUM_TILES,
                                                             tl.cdiv(T, BLOCK_M), T, NK, PACKED)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // G).to(tl.int64)
    h64 = h.to(tl.int64)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < num_q
    d_ok = offs_d < D
    row_mask = m_ok[:, None] & d_ok[None, :]
    rows = offs_m.to(tl.int64)
    q = load_rows(Q + b * sqb + h64 * sqh + q0 * sqt, rows, sqt, offs_d, row_mask)
    do = load_rows(DO + b * sdob + h64 * sdoh + q0 * sdot, rows, sdot, offs_d, row_mask)
    lse2 = tl.load(LSE2 + (b * H + h64) * T + q0 + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + (b * H + h64) * T + q0 + offs_m, mask=m_ok, other=0.0)

    # Query i of the tile's document stands at position pos0 + i.
    n_lo, n_hi = _visible_key_range(tile * BLOCK_M + pos0, BLOCK_M, num_q + pos0, num_k, KEY_STRIDE, KEY_OFFSET,
                                    WINDOW)

    if SELECTED:
        picks = _selections(CHOSEN, b, hk, q0 + offs_m, m_ok, scb, sct, sch, NUM_SEL, BLOCK_S)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * skb + hk * skh + k0 * skt
    v_base = V + b * svb + hk * svh + k0 * svt
    for start in range(n_lo, n_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = load_rows(k_base, offs_n.to(tl.int64), skt, offs_d, kv_mask)
        v = load_rows(v_base, offs_n.to(tl.int64), svt, offs_d, kv_mask)
        seen = _visible(offs_m + pos0, offs_n, KEY_STRIDE, KEY_OFFSET, WINDOW) & n_ok[None, :]
        if SELECTED:
            seen &= _chose(picks, start // SEL_BLOCK)[:, None]
        _, ds = softmax_grads(q, k, v, do, lse2, delta, seen, qk_scale, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    tl.store(DQ + b * sdqb + h64 * sdqh + (q0 + rows)[:, None] * sdqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_mask)


@triton.jit
def _interval_attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, TILES, Q_STARTS, K_STARTS, Q_POS0, CHOSEN, scb, sct, sch, SEL_BLOCK, NUM_SEL,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh,
    sdks, sdkb, sdkt, sdkh, sdvs, sdvb, sdvt, sdvh,
    T, NK, H, G, HO, NUM_ROWS, SPLIT_QUERIES, NUM_TILES, KEY_STRIDE, KEY_OFFSET, WINDOW, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PACKED: tl.constexpr, SELECTED: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One program per (key tile, output head, query split). HO output heads: Hkv (each program sums
    # its G query heads itself) or H (one query head each; the caller sums groups in a fixed order).
    # Split s takes the s-th run of SPLIT_QUERIES of the queries that see the tile and writes its own
    # partial (the caller sums splits in order). No two programs write the same element:
    # deterministic, no atomics. A tile of one document's keys (the tile table runs over keys here).
    tile, pid_bh, q0, num_q, k0, num_k, pos0 = document_tile(TILES, Q_STARTS, K_STARTS, Q_POS0, NUM_TILES,
                                                             tl.cdiv(NK, BLOCK_N), T, NK, PACKED)
    split = pid_bh // NUM_ROWS  # int32 here (split * SPLIT_QUERIES < T); int64 only in the stores' offsets
    pid_bh = pid_bh % NUM_ROWS
    b = (pid_bh // HO).to(tl.int64)
    ho = pid_bh % HO
    heads_per_program = H // HO
    h_first = ho * heads_per_program
    hk = (h_first // G).to(tl.int64)

    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < num_k
    d_ok = offs_d < D
    kv_mask = n_ok[:, None] & d_ok[None, :]
    keys = offs_n.to(tl.int64)
    k = load_rows(K + b * skb + hk * skh + k0 * skt, keys, skt, offs_d, kv_mask)
    v = load_rows(V + b * svb + hk * svh + k0 * svt, keys, svt, offs_d, kv_mask)

    # Queries that see any key of the tile stand at positions [kpos(first), kpos(last) + window);
    # query i of the document at pos0 + i.
    n_last = tl.minimum(tile * BLOCK_N + BLOCK_N, num_k) - 1
    t_first = tl.minimum(tl.maximum(tile * BLOCK_N * KEY_STRIDE + KEY_OFFSET - pos0, 0), num_q)
    t_end = tl.minimum(tl.maximum(n_last * KEY_STRIDE + KEY_OFFSET + tl.minimum(WINDOW, num_q + pos0) - pos0, 0),
                       num_q)
    t_lo = tl.minimum(t_first + split * SPLIT_QUERIES, t_end)
    t_hi = tl.minimum(t_lo + SPLIT_QUERIES, t_end)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for i in range(heads_per_program):
        h64 = (h_first + i).to(tl.int64)
        for start in range(t_lo, t_hi, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            m_ok = offs_m < t_hi
            row_mask = m_ok[:, None] & d_ok[None, :]
            rows = offs_m.to(tl.int64)
            q = load_rows(Q + b * sqb + h64 * sqh + q0 * sqt, rows, sqt, offs_d, row_mask)
            do = load_rows(DO + b * sdob + h64 * sdoh + q0 * sdot, rows, sdot, offs_d, row_mask)
            lse2 = tl.load(LSE2 + (b * H + h64) * T + q0 + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(DELTA + (b * H + h64) * T + q0 + offs_m, mask=m_ok, other=0.0)
            seen_t = (_seen_by_keys(offs_n, offs_m + pos0, KEY_STRIDE, KEY_OFFSET, WINDOW)
                      & n_ok[:, None] & m_ok[None, :])
            if SELECTED:
                picks = _selections(CHOSEN, b, hk, q0 + offs_m, m_ok, scb, sct, sch, NUM_SEL, BLOCK_S)
                seen_t &= _chose(picks, tile * BLOCK_N // SEL_BLOCK)[None, :]
            p_t, ds_t = softmax_grads_by_key(q, k, v, do, lse2, delta, seen_t, qk_scale, PRECISION)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)

    ho64 = ho.to(tl.int64)
    tl.store(DK + split.to(tl.int64) * sdks + b * sdkb + ho64 * sdkh + (k0 + keys)[:, None] * sdkt + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + split.to(tl.int64) * sdvs + b * sdvb + ho64 * sdvh + (k0 + keys)[:, None] * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


def _nonempty(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """No keys (T < l leaves no compressed block): kernels load nothing, but still need real addresses."""
    if k.shape[1] > 0:
        return k, v
    stand_in = k.new_zeros(k.shape[0], 1, *k.shape[2:])
    return stand_in, stand_in


UNBOUNDED = 2**30  # a window no position reaches past, with room below 2**31 for the kernels' sums


def _effective_window(window: int, num_queries: int, query_offsets: bool) -> int:
    """0 means unbounded; any window past T + 1 hides nothing, and a small one avoids int overflow.
    With query offsets positions run past the query count, so unbounded stays UNBOUNDED."""
    if query_offsets:
        return window if 0 < window < UNBOUNDED else UNBOUNDED
    return num_queries + 1 if window <= 0 or window > num_queries else window


def interval_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_stride: int, key_offset: int,
                           window: int, sm_scale: float, cu_seqlens: torch.Tensor | None = None,
                           cu_seqlens_q: torch.Tensor | None = None,
                           chosen: Chosen | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, H, D] in q's dtype, lse2 [B, H, T] fp32) of the interval-masked attention; with
    cu_seqlens (B = 1), of each packed document on its own; with cu_seqlens_q too, each document's
    queries are its last ones. `chosen` hides, per query, the key blocks its group did not select."""
    B, T, H, D = q.shape
    NK, Hkv = k.shape[1], k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse2 = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    if B * T * H == 0:
        return o, lse2
    k, v = _nonempty(k, v)
    block_m, block_n, warps, stages = tile_configs.tiles("interval_fwd", head_block(D), q.element_size())
    block_n = chosen.key_tile(block_n) if chosen else block_n
    docs = DocumentTables.of(cu_seqlens, key_stride, key_offset, cu_seqlens_q)
    *tables, num_tiles = docs.tiles(block_m, T)
    _interval_attn_fwd_kernel[flat_grid(num_tiles or cdiv(T, block_m), B * H)](
        q, k, v, o, lse2, *tables, *Chosen.arguments(chosen),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        T, NK, H, H // Hkv, num_tiles, key_stride, key_offset, _effective_window(window, T, cu_seqlens_q is not None),
        sm_scale * LOG2E,
        D=D, BLOCK_D=head_block(D), BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype),
        PACKED=docs.packed, **Chosen.constants(chosen), num_warps=warps, num_stages=stages,
    )
    return o, lse2


def interval_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                           lse2: torch.Tensor, key_stride: int, key_offset: int, window: int, sm_scale: float,
                           cu_seqlens: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                           per_head: bool | None = None, split_queries: int | None = None,
                           chosen: Chosen | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the dtypes of (q, k, v). `per_head` forces how dK/dV work is split (one
    program per query head, or per KV group) and `split_queries` how many of the queries that see a
    key tile one program takes; by default both follow the amount of parallelism (dkdv_query_split).
    `chosen` as for the forward."""
    B, T, H, D = q.shape
    NK, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if B * T * H == 0:
        return dq.zero_(), dk, dv
    delta = softmax_delta(do, o)  # [B, H, T]
    k, v = _nonempty(k, v)
    window = _effective_window(window, T, cu_seqlens_q is not None)
    docs = DocumentTables.of(cu_seqlens, key_stride, key_offset, cu_seqlens_q)
    common = dict(D=D, BLOCK_D=head_block(D), PRECISION=dot_precision(q.dtype), PACKED=docs.packed,
                  **Chosen.constants(chosen))

    block_m, block_n, warps, stages = tile_configs.tiles("interval_dq", head_block(D), q.element_size())
    block_n = chosen.key_tile(block_n) if chosen else block_n
    *tables, num_tiles = docs.tiles(block_m, T)
    _interval_attn_bwd_dq_kernel[flat_grid(num_tiles or cdiv(T, block_m), B * H)](
        q, k, v, do, lse2, delta, dq, *tables, *Chosen.arguments(chosen),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        T, NK, H, G, num_tiles, key_stride, key_offset, window, sm_scale * LOG2E, sm_scale,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )
    if NK == 0:
        return dq, dk, dv

    # Few key tiles (the compressed branch has T/d keys) leave the GPU idle when a program owns
    # a whole group; then give each query head its own program and sum the group afterwards.
    block_m, block_n, warps, stages = tile_configs.tiles("interval_dkdv", head_block(D), q.element_size())
    block_n = chosen.key_tile(block_n) if chosen else block_n
    *tables, num_tiles = docs.tiles(block_n, NK, over_keys=True)
    key_tiles = num_tiles or cdiv(NK, block_n)
    if per_head is None:
        per_head = G > 1 and B * Hkv * key_tiles < 1024
    HO = H if per_head else Hkv
    span = min(T, (block_n - 1) * key_stride + window)  # the most queries one key tile is seen by
    split_queries = split_queries or dkdv_query_split(span, key_tiles * B * HO)
    splits = cdiv(span, split_queries)
    partials = per_head or splits > 1  # fp32 partials, summed below in a fixed order
    if partials:
        dk_out = torch.empty(splits, B, NK, HO, D, device=q.device, dtype=torch.float32)
        dv_out = torch.empty(splits, B, NK, HO, D, device=q.device, dtype=torch.float32)
    else:
        dk_out, dv_out = dk.unsqueeze(0), dv.unsqueeze(0)
    _interval_attn_bwd_dkdv_kernel[flat_grid(key_tiles, B * HO * splits)](
        q, k, v, do, lse2, delta, dk_out, dv_out, *tables, *Chosen.arguments(chosen),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        *dk_out.stride()[:4], *dv_out.stride()[:4],
        T, NK, H, G, HO, B * HO, split_queries, num_tiles, key_stride, key_offset, window, sm_scale * LOG2E, sm_scale,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )
    if partials:
        dk = dk_out.view(splits, B, NK, Hkv, HO // Hkv, D).sum((0, 4)).to(k.dtype)
        dv = dv_out.view(splits, B, NK, Hkv, HO // Hkv, D).sum((0, 4)).to(v.dtype)
    return dq, dk, dv


DKDV_TARGET_PROGRAMS = 2048  # enough programs to fill a GPU several times over
DKDV_MIN_SPLIT_QUERIES = 2048  # no split below this: a program's loop stays long enough to pay off


def dkdv_query_split(span: int, programs: int) -> int:
    """Queries per dK/dV program: all `span` queries that can see a key tile, or where `programs`
    (key tiles x batch x output heads) are too few to fill the GPU, runs of at least
    DKDV_MIN_SPLIT_QUERIES so that about DKDV_TARGET_PROGRAMS programs run. The compressed branch's
    first key tiles are seen by every later query: without splits its longest program walks the whole
    row while few run beside it."""
    splits = max(1, min(span // DKDV_MIN_SPLIT_QUERIES, DKDV_TARGET_PROGRAMS // max(programs, 1)))
    return max(1, cdiv(span, splits))
