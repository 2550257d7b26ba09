"""Block selection: which n selection blocks each (query, KV group) attends to (NSA_SPEC.md section 2).

Importance comes from the compressed branch's attention probabilities, spread onto selection
blocks by the token overlap of compression and selection blocks, summed over the G heads of the
group, in fp32 (fp64 for fp64 inputs). Selection is discrete and carries no gradient.
"""

from __future__ import annotations

import torch

from components.nsa.chunked_attention import chunk_probabilities, key_layout, query_chunk_size, query_layout
from components.nsa.hyperparams import num_selection_blocks
from components.nsa.masks import CompressedRule
from components.nsa.precision import without_autocast


def _overlap_in_strides(
    num_cmp_blocks: int, num_sel_blocks: int, block_size: int, block_stride: int, sel_block_size: int,
    device: torch.device | str | None,
) -> torch.Tensor:
    """LongTensor [Tc, Ts]: shared tokens of compression block i and selection block j, divided by d.

    Every block boundary is a multiple of d (d divides l and l'), so the count is exact when
    measured in strides: block i spans strides [i, i + l/d), block j spans [j*l'/d, (j+1)*l'/d).
    """
    span, sel_span = block_size // block_stride, sel_block_size // block_stride
    i = torch.arange(num_cmp_blocks, device=device)[:, None]
    j = torch.arange(num_sel_blocks, device=device)[None, :]
    lo = torch.maximum(i, j * sel_span)
    hi = torch.minimum(i + span, (j + 1) * sel_span)
    return (hi - lo).clamp_min(0)


def overlap_tokens(
    num_cmp_blocks: int, num_sel_blocks: int, block_size: int, block_stride: int, sel_block_size: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """LongTensor [Tc, Ts]: tokens shared by compression block i [i*d, i*d+l) and selection block j."""
    shared = _overlap_in_strides(num_cmp_blocks, num_sel_blocks, block_size, block_stride, sel_block_size, device)
    return shared * block_stride


def overlap_weights(
    num_cmp_blocks: int, num_sel_blocks: int, block_size: int, block_stride: int, sel_block_size: int,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[Tc, Ts] weights ov(i, j) in units of the stride d: shared tokens / d, small exact integers.

    1, 2, 2, 2, 1 on compression blocks 4j-1 .. 4j+3 for l=32, d=16, l'=64. Dividing the token
    counts by d scales every score by the same constant, which changes no ranking.
    """
    shared = _overlap_in_strides(num_cmp_blocks, num_sel_blocks, block_size, block_stride, sel_block_size, device)
    return shared.to(dtype)


def spread_over_selection_blocks(p: torch.Tensor, num_sel_blocks: int, block_size: int, block_stride: int,
                                 sel_block_size: int) -> torch.Tensor:
    """p [..., Tc] @ overlap_weights(Tc, Ts) -> [..., Ts], multiplying only the overlapping pairs.

    Compression block i and selection block j overlap by a weight that depends on i - j*l'/d alone, and
    only for l'/d + l/d - 1 values of it: each selection block reads that window of p (zero-padded at the
    ends) against one band of weights. Linear in Tc, where the [Tc, Ts] matrix grows with its square.
    """
    span, sel_span = block_size // block_stride, sel_block_size // block_stride
    offsets = torch.arange(1 - span, sel_span, device=p.device)  # i - j * sel_span
    band = ((offsets + span).clamp_max(sel_span) - offsets.clamp_min(0)).to(p.dtype)
    # Window j starts at block j * sel_span - (span - 1); the padding fills blocks before 0 and after Tc - 1.
    padded = torch.nn.functional.pad(p, (span - 1, num_sel_blocks * sel_span - p.shape[-1]))
    return torch.matmul(padded.unfold(-1, band.numel(), sel_span), band)


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bfloat16/fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def selection_scores_at(
    q: torch.Tensor, k_cmp: torch.Tensor, *, q_start: int, block_size: int, block_stride: int, sel_block_size: int,
) -> torch.Tensor:
    """Group scores s [B, Tq, Hkv, Ts] for queries at positions q_start .. q_start + Tq - 1.

    s[t, g, j] = sum over the heads h of group g of sum_i ov(i, j) * p_cmp[t, h, i]. Summing the
    heads first and applying ov once gives the same value, G times cheaper.
    """
    B, Tq, H, _ = q.shape
    Tc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    Ts = num_selection_blocks(q_start + Tq, sel_block_size)
    dtype = score_dtype(q.dtype)
    scores = torch.zeros(B, Hkv, Tq, Ts, dtype=dtype, device=q.device)
    if Tc == 0:
        return scores.permute(0, 2, 1, 3)
    rule = CompressedRule(block_size, block_stride, Tc, q.device)
    ov = overlap_weights(Tc, Ts, block_size, block_stride, sel_block_size, q.device, dtype)
    qh = query_layout(q, Hkv, dtype)  # [B, Hkv, Tq, G, D]
    kh = key_layout(k_cmp, dtype)  # [B, Hkv, Tc, D]
    chunk = query_chunk_size(B, H, Tc, Tq)
    for c0 in range(0, Tq, chunk):
        c1 = min(Tq, c0 + chunk)
        p0, p1 = q_start + c0, q_start + c1
        _, k1 = rule.key_range(p0, p1)
        if k1 == 0:
            continue  # no query here sees a compressed block: all scores 0, forced blocks decide
        probs = chunk_probabilities(qh, kh, rule, p0, p1, c0, c1, 0, k1)  # [B, Hkv, C, G, k1]
        scores[:, :, c0:c1] = torch.matmul(probs.sum(dim=3), ov[:k1])
    return scores.permute(0, 2, 1, 3)


def _best_first(ranked: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the last dim, ties to the smaller index, deterministically.

    fp32: one topk over distinct int64 keys bits(score) * 2**32 - j. The IEEE bit pattern read
    as a signed int orders like the value (+0 .. +inf ascending, every negative value, -inf
    included, below +0), so the keys order like (score, -j) and topk has no ties to break.
    Several times faster than a sort on CPU. fp64: a stable descending sort.
    """
    if ranked.dtype == torch.float32:
        j = torch.arange(ranked.shape[-1], device=ranked.device)
        keys = torch.add(-j, ranked.view(torch.int32).to(torch.int64), alpha=2**32)
        return torch.topk(keys, k, dim=-1, sorted=True).indices
    return torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]


def forced_ranks(dtype: torch.dtype) -> tuple[float, float, float]:
    """Scores that place the current block, block 0 and the previous block above every real score, in
    that order: +inf, the largest finite value and the one below it."""
    largest = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    below = torch.nextafter(largest, torch.zeros((), dtype=dtype))
    return float("inf"), largest.item(), below.item()


def top_blocks(scores: torch.Tensor, *, q_start: int, sel_block_size: int, num_selected: int) -> torch.Tensor:
    """Pick n blocks per row of group scores [B, Tq, Hkv, Ts] (all >= 0) -> LongTensor [B, Tq, Hkv, n].

    Valid blocks for query t: j <= t // l'. The current block, block 0 and the previous one rank
    above every score, in that order (it decides which survive when n < 3); the rest go by score,
    ties to the smaller j. Output ascending, -1 after the last chosen block when fewer than n
    blocks are valid.
    """
    B, Tq, Hkv, Ts = scores.shape
    device = scores.device
    current = torch.arange(q_start, q_start + Tq, device=device) // sel_block_size  # [Tq]
    j = torch.arange(Ts, device=device)
    valid = j[None, :] <= current[:, None]
    # Forced blocks get the three largest values of the dtype (any score plus one of them rounds back
    # to it: scores are at most G * l / d), -inf rules out; adding +0.0 also turns -0.0 into +0.0.
    top, second, third = forced_ranks(scores.dtype)
    bias = torch.zeros(Tq, Ts, dtype=scores.dtype, device=device)
    bias = bias.masked_fill_(j[None, :] == current[:, None] - 1, third).masked_fill_(j[None, :] == 0, second)
    bias = bias.masked_fill_(j[None, :] == current[:, None], top).masked_fill_(~valid, float("-inf"))
    order = _best_first(scores + bias[None, :, None, :], min(num_selected, Ts))
    if order.shape[-1] < num_selected:
        order = torch.cat([order, order.new_zeros(B, Tq, Hkv, num_selected - order.shape[-1])], dim=-1)
    # Invalid blocks rank last, so the first (current + 1) slots are exactly the valid picks.
    used = torch.arange(num_selected, device=device)[None, :] <= current[:, None]  # [Tq, n]
    used = used[None, :, None, :]
    ascending = torch.where(used, order, Ts).sort(dim=-1).values
    return torch.where(ascending == Ts, -1, ascending)


@without_autocast
@torch.no_grad()
def select_blocks_at_reference(
    q: torch.Tensor, k_cmp: torch.Tensor, *, q_start: int, block_size: int, block_stride: int,
    sel_block_size: int, num_selected: int,
) -> torch.Tensor:
    """Selected blocks [B, Tq, Hkv, n] for queries at q_start .. q_start + Tq - 1 (inputs validated)."""
    scores = selection_scores_at(
        q, k_cmp, q_start=q_start, block_size=block_size, block_stride=block_stride, sel_block_size=sel_block_size
    )
    return top_blocks(scores, q_start=q_start, sel_block_size=sel_block_size, num_selected=num_selected)

