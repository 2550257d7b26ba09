"""What the NSA layers choose: telemetry (gate statistics, how far back the selected blocks lie)
and the per-layer maps the engine's plots draw.

The training forward is left untouched (no hooks, no extra outputs, so compiled graphs stay as
they are). Both run one walk, `nsa_layer_outputs`: a separate no-grad forward that runs each
block's plain `forward` (eager even after `block.compile()`) and asks each NSA layer for its gates
and selection on the same input its forward sees. Results are tensors on the model's device; the
caller decides when to copy them to the host.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from components.errors import UserError
from components.model_hooks import AttentionMap
from components.models.nsa_attention import BRANCHES, NSAAttention

COLLAPSE_LOW, COLLAPSE_HIGH = 0.05, 0.95


def gate_stats(gates: torch.Tensor) -> dict[str, torch.Tensor]:
    """gates [..., 3] -> per branch: mean, mean binary entropy in bits (1 = undecided, 0 = saturated),
    and the collapse fraction (share of gates < 0.05 or > 0.95)."""
    g = gates.float()
    entropy = -(torch.special.xlogy(g, g) + torch.special.xlogy(1 - g, 1 - g)) / math.log(2)
    collapsed = ((g < COLLAPSE_LOW) | (g > COLLAPSE_HIGH)).float()
    stats = {}
    for i, branch in enumerate(BRANCHES):
        stats[f"{branch}/gate_mean"] = g[..., i].mean()
        stats[f"{branch}/gate_entropy"] = entropy[..., i].mean()
        stats[f"{branch}/gate_collapse"] = collapsed[..., i].mean()
    return stats


def distance_bucket_labels(num_buckets: int) -> list[str]:
    """'0', '1', '2-3', '4-7', ..., '2^(num_buckets-2)+' (distances in selection blocks)."""
    labels = ["0"] + [f"{2 ** (b - 1)}-{2 ** b - 1}" if b > 1 else "1" for b in range(1, num_buckets - 1)]
    return labels + [f"{2 ** (num_buckets - 2)}+"]


def selection_distance_hist(selected: torch.Tensor, sel_block_size: int, num_buckets: int = 8,
                            positions: torch.Tensor | None = None) -> torch.Tensor:
    """selected [B, T, Hkv, n] (-1 unused) -> [num_buckets] share of the selected blocks at each
    distance (query's current block minus selected block), bucketed as `distance_bucket_labels`.
    positions [B, T]: each query's position in its document (packed documents), else 0 .. T-1."""
    counts = selection_distance_counts(selected, sel_block_size, num_buckets, positions)
    return counts / counts.sum().clamp(min=1)


def selection_distance_counts(selected: torch.Tensor, sel_block_size: int, num_buckets: int = 8,
                              positions: torch.Tensor | None = None) -> torch.Tensor:
    """The selected blocks per distance bucket, as selection_distance_hist before it normalises."""
    if positions is None:
        positions = torch.arange(selected.shape[1], device=selected.device)[None]
    current = (positions // sel_block_size)[:, :, None, None]
    valid = selected >= 0
    distance = torch.where(valid, current - selected, torch.zeros_like(selected))
    edges = 2 ** torch.arange(num_buckets - 1, device=selected.device)  # 1, 2, 4, ...
    bucket = torch.searchsorted(edges, distance.flatten().contiguous(), right=True)
    return torch.zeros(num_buckets, device=selected.device).scatter_add_(0, bucket, valid.flatten().float())


@contextlib.contextmanager
def _unsharded(model: nn.Module):
    """FSDP2-sharded modules (anything with unshard/reshard) are gathered while the eager calls run."""
    sharded = [m for m in (model, *model.layers) if callable(getattr(m, "unshard", None))]
    for m in sharded:
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.reshard()


def telemetry_applies(args) -> bool:
    """Only NSA layers have gates and selections to report."""
    return args.attention == "nsa"


def nsa_layer_outputs(model: nn.Module, tokens: torch.Tensor, documents=None, context=None):
    """The one forward walk: (layer index, NSA layer, gates [B, T, H, 3], selected [B, T, Hkv, n]) for
    each NSA layer of a Transformer (unwrapped; sharded ones inside _unsharded), on tokens [B, T] and
    optionally their packed documents (a DocumentLayout, as the model's forward builds it), or under
    context parallelism on this rank's share of the rows and its ContextShard."""
    cos, sin = model.rope.cos, model.rope.sin
    where = {"context": context} if context is not None else {} if documents is None else {"documents": documents}
    h = model.tok_embeddings(tokens)
    for i, block in enumerate(model.layers):
        attention = block.attention
        if isinstance(attention, NSAAttention):
            gates, selected = attention.gates_and_selection(block.attention_norm(h), cos, sin, **where)
            yield i, attention, gates, selected
        h = block.forward(h, cos, sin, **where)


@torch.no_grad()
def collect_nsa_telemetry(model: nn.Module, tokens: torch.Tensor, documents=None, *, num_buckets: int = 8,
                          context=None) -> dict[str, torch.Tensor]:
    """Per NSA layer i, 0-d tensors keyed 'nsa/layer{i}/{cmp|sel|win}/gate_{mean|entropy|collapse}'
    and 'nsa/layer{i}/sel_distance/{bucket label}' (shares summing to 1; distances within documents
    when documents are given).

    `model` is the Transformer itself (unwrap DDP's `.module`); tokens [B, T] and documents (the
    document_starts [B, T] or their layout) as for forward. Under context parallelism: this rank's
    share of the rows and the forward's `context`; the ranks of the group combine their numbers (a
    collective: every rank of the group calls it) into those of the whole rows.
    """
    if num_buckets < 2:
        raise UserError(f"num_buckets must be >= 2 (distance 0 and the rest), got {num_buckets}")
    labels = distance_bucket_labels(num_buckets)
    if isinstance(documents, torch.Tensor):
        documents = model.document_layout(documents, tokens.device)
    if context is not None:
        positions = context.query_positions.view(tokens.shape)
    else:
        positions = None if documents is None else documents.positions.view(tokens.shape)
    means: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    with _unsharded(model):
        for i, attention, gates, selected in nsa_layer_outputs(model, tokens, documents, context):
            means.update({f"nsa/layer{i}/{key}": value for key, value in gate_stats(gates).items()})
            counts[f"nsa/layer{i}/"] = selection_distance_counts(selected, attention.selection["sel_block_size"],
                                                                 num_buckets, positions)
    if context is not None and context.shard.size > 1:
        _combine_over_ranks(means, counts, context.shard)
    stats = dict(means)
    for prefix, bucket_counts in counts.items():
        shares = bucket_counts / bucket_counts.sum().clamp(min=1)
        stats.update({f"{prefix}sel_distance/{label}": shares[b] for b, label in enumerate(labels)})
    return stats


def _combine_over_ranks(means: dict, counts: dict, shard) -> None:
    """Means over equal shares of the tokens average; counts add (in place, one all-reduce)."""
    import torch.distributed as dist

    if not means:
        return
    n = len(means)
    mean_dtype, count_dtype = next(iter(means.values())).dtype, next(iter(counts.values())).dtype
    flat = torch.cat([torch.stack(list(means.values())).double(), *(c.double() for c in counts.values())])
    dist.all_reduce(flat, group=shard.group)
    means.update(zip(means, (flat[:n] / shard.size).to(mean_dtype).unbind()))
    counts.update(zip(counts, flat[n:].to(count_dtype).split([c.numel() for c in counts.values()])))


@contextlib.contextmanager
def _on_reference_backend(model: nn.Module):
    """Every NSA layer computes with the exact reference backend meanwhile (same results, any device)."""
    layers = [block.attention for block in model.layers if isinstance(block.attention, NSAAttention)]
    chosen = [layer.backend for layer in layers]
    for layer in layers:
        layer.backend = "reference"
    try:
        yield
    finally:
        for layer, backend in zip(layers, chosen):
            layer.backend = backend


@torch.no_grad()
def attention_maps(model: nn.Module, tokens: torch.Tensor, context=None) -> dict[int, AttentionMap]:
    """layer index -> what that NSA layer chose on tokens [B, T] (one document a row), on any device
    (the walk uses the reference backend). Sharded models are gathered meanwhile: every rank calls it.
    Under context parallelism: this rank's share of the rows and the forward's context (its documents);
    the maps are the whole rows', gathered from the group."""
    maps = {}
    with _on_reference_backend(model), _unsharded(model):
        for i, layer, gates, selected in nsa_layer_outputs(model, tokens, context=context):
            if context is not None:
                gates, selected = context.shard.gather(gates), context.shard.gather(selected)
            maps[i] = AttentionMap(gates, selected, block_tokens=layer.selection["sel_block_size"],
                                   groups=layer.n_kv_heads, branches=BRANCHES,
                                   legend={"sel_block_size": layer.selection["sel_block_size"],
                                           "num_selected": layer.selection["num_selected"],
                                           "groups": layer.n_kv_heads,
                                           "query_heads_per_group": layer.n_heads // layer.n_kv_heads})
    return maps
