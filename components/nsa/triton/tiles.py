"""Tile steps the NSA attention kernels share, as @triton.jit functions (inlined where called).

Logits are base 2 (the caller scales q.k by sm_scale * log2(e)); lse2 is the matching
log2-sum-exp2, +inf for a row that saw no key.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grid_position(NUM_TILES):
    """(tile, row) of this program in a launch of flat_grid(NUM_TILES, rows): tiles vary fastest,
    so neighbouring programs share a row's keys, as the axis-0 order of a 2-D grid would."""
    pid = tl.program_id(0)
    return pid % NUM_TILES, pid // NUM_TILES


@triton.jit
def load_rows(base, rows, stride, offs_d, mask):
    """A [len(rows), BLOCK_D] tile: row r at base + rows[r] * stride, the head dim dense; 0 where masked."""
    return tl.load(base + rows[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, PRECISION: tl.constexpr):
    """Fold one tile of logits s [M, N] (-inf where hidden) and its values v [N, D] into the running
    row max m_i, sum l_i and unnormalised output acc; returns the three updated."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet keeps max -inf; shifting by 0 keeps exp2 at 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def softmax_result(m_i, l_i, acc):
    """(normalised output, lse2) of finished rows; a row that saw no key gets 0 and +inf."""
    seen_any = l_i > 0.0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    lse2 = tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), float("inf"))
    return o, lse2


@triton.jit
def softmax_grads(q, k, v, do, lse2, delta, seen, qk_scale, PRECISION: tl.constexpr):
    """Backward of one (rows x keys) tile: the probabilities P recomputed from lse2 (0 where not
    seen) and dS = P * (dO.V^T - delta), with delta = rowsum(dO * O)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.where(seen, tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def softmax_grads_by_key(q, k, v, do, lse2, delta, seen_t, qk_scale, PRECISION: tl.constexpr):
    """softmax_grads of one tile laid out (keys x rows), its transpose: (P^T, dS^T) from k.q^T and v.dO^T,
    seen_t [keys, rows]. dK += dS^T.q and dV += P^T.dO then take them as a dot's first operand as they
    are: no dot's result is transposed to feed another dot, a shape Hopper builds of Triton have
    miscompiled (tl.dot(tl.trans(ds), q) gave a wrong dK, dV right: triton-lang/triton#6124)."""
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
    p_t = tl.where(seen_t, tl.exp2(s_t - lse2[None, :]), 0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    return p_t, p_t * (dp_t - delta[None, :])


@triton.jit
def document_tile(TILES, Q_STARTS, K_STARTS, Q_POS0, NUM_TILES, row_tiles, T, NK, PACKED: tl.constexpr):
    """(tile, row, q0, num_q, k0, num_k, pos0) of this program: its tile within its document and its
    row (batch x heads) as grid_position gives them, where the document's queries start (int64) and
    how many there are, the same for its keys, and the position of its first query (nonzero only
    with query offsets: query i of the document stands at pos0 + i). With PACKED the launch runs over
    a tile table (packing.py) of NUM_TILES programs per row; without, the row is one document of T
    queries and NK keys in row_tiles tiles, and nothing is loaded (NUM_TILES is then None: an unused
    argument would still change the compiled kernel)."""
    if PACKED:
        pid, row = grid_position(NUM_TILES)
        doc = tl.load(TILES + pid)
        q0 = tl.load(Q_STARTS + doc)
        k0 = tl.load(K_STARTS + doc)
        return (tl.load(TILES + NUM_TILES + pid), row, q0.to(tl.int64), tl.load(Q_STARTS + doc + 1) - q0,
                k0.to(tl.int64), tl.load(K_STARTS + doc + 1) - k0, tl.load(Q_POS0 + doc))
    else:
        pid, row = grid_position(row_tiles)
        return pid, row, 0, T, 0, NK, 0


@triton.jit
def token_in_document(TOKEN_TABLE, t, T, PACKED: tl.constexpr):
    """(where query t's document starts among the keys, as int64; t's position in its document), from
    packing.query_token_table [2, T]. Without PACKED: (0, t)."""
    if PACKED:
        start = tl.load(TOKEN_TABLE + t)
        return start.to(tl.int64), t - tl.load(TOKEN_TABLE + T + t)
    else:
        return 0, t
