"""Orthogonalize many row-sharded matrices, each rank of the shard group computing its share of them.

Muon's update of a matrix needs the whole matrix. With FSDP2 every rank holds a block of rows of each
(a DTensor sharded on dim 0 over one mesh dimension, replicated over any other). Gathering every
matrix whole on every rank would repeat every iteration S times and move S times the data. Instead,
matrices are dealt out in turns, matrix j of a turn to the group's rank j:

  1. an all-to-all sends each rank's rows of matrix j to rank j, which puts the whole matrix together;
  2. rank j orthogonalizes it;
  3. an all-to-all sends every rank its rows of the result back.

Each rank runs about N / S of the N iterations, and two collectives per turn of S matrices replace N
all-gathers. The result is the one the whole matrix gives (the same function of the same numbers), so
a sharded run updates exactly as one process does. Plain tensors, and DTensors laid out otherwise,
are orthogonalized whole (gathered, where they are DTensors).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

Orthogonalize = Callable[[torch.Tensor], torch.Tensor]


def orthogonalize_all(updates: list[torch.Tensor], orthogonalize: Orthogonalize) -> list[torch.Tensor]:
    """For each update, `orthogonalize(whole update)` in the update's dtype and layout: a DTensor's result is
    a DTensor of the same placements (this rank's rows), a tensor's a tensor."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    by_group: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        layout = _row_shard_group(u)
        if layout is None:
            results[i] = _whole_then_like(u, orthogonalize)
        else:
            by_group.setdefault(layout, []).append(i)
    for (mesh, dim), indices in by_group.items():
        shards = _dealt_out(mesh, dim, [updates[i] for i in indices], orthogonalize)
        for i, local in zip(indices, shards):
            results[i] = _from_local(local, updates[i])
    return results


def _row_shard_group(u: torch.Tensor) -> tuple | None:
    """(mesh, mesh dimension) when `u` is a 2-D DTensor whose rows are sharded over that one dimension (the
    others replicated) as torch.chunk splits them; else None."""
    if not hasattr(u, "device_mesh") or u.ndim != 2 or u.device_mesh.ndim != len(u.placements):
        return None
    sharded = [d for d, p in enumerate(u.placements) if not p.is_replicate()]
    if len(sharded) != 1 or not (u.placements[sharded[0]].is_shard() and u.placements[sharded[0]].dim == 0):
        return None
    mesh, dim = u.device_mesh, sharded[0]
    if u.to_local().shape[0] != _row_counts(u.shape[0], mesh.size(dim))[mesh.get_local_rank(dim)]:
        return None  # not the split this module assumes: take the safe path
    return mesh, dim


def _row_counts(rows: int, parts: int) -> list[int]:
    """Rows per rank as torch.chunk (and DTensor's Shard) split them: full chunks first, then what is left."""
    counts = [len(c) for c in torch.arange(rows).chunk(parts)]
    return counts + [0] * (parts - len(counts))


def _dealt_out(mesh, dim: int, updates: list[torch.Tensor], orthogonalize: Orthogonalize) -> list[torch.Tensor]:
    """This rank's rows of each update's result, the matrices dealt out over the group's ranks in turns."""
    group, me, size = mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim)
    mine: list[torch.Tensor] = []
    for start in range(0, len(updates), size):
        turn = updates[start:start + size]  # matrix j of the turn is rank j's to compute
        locals_ = [u.to_local() for u in turn]
        rows = [_row_counts(u.shape[0], size) for u in turn]
        owns = me < len(turn)
        # 1. my rows of matrix j go to rank j; I get every rank's rows of my matrix
        sent = [locals_[j].numel() if j < len(turn) else 0 for j in range(size)]
        got = [rows[me][s] * turn[me].shape[1] for s in range(size)] if owns else [0] * size
        parts = _exchange(torch.cat([t.contiguous().flatten() for t in locals_]), sent, got, group)
        # 2. my matrix, whole, orthogonalized, cut back into the ranks' rows
        if owns:
            whole = parts.view(turn[me].shape)
            back = orthogonalize(whole).to(whole.dtype).contiguous().flatten()
        else:
            back = locals_[0].new_empty(0)
        # 3. rank j's result comes back to me as my rows of matrix j
        results = _exchange(back, got, sent, group)
        mine += list(torch.split(results, sent[:len(turn)]))
        mine[-len(turn):] = [m.view(local.shape) for m, local in zip(mine[-len(turn):], locals_)]
    return mine


def _exchange(send: torch.Tensor, send_counts: list[int], receive_counts: list[int], group) -> torch.Tensor:
    """One all-to-all of flat pieces of different lengths (the i-th piece of `send` goes to rank i)."""
    received = send.new_empty(sum(receive_counts))
    dist.all_to_all_single(received, send, output_split_sizes=receive_counts, input_split_sizes=send_counts,
                           group=group)
    return received


def _from_local(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _whole_then_like(u: torch.Tensor, orthogonalize: Orthogonalize) -> torch.Tensor:
    """The safe path: the whole matrix on every rank (gathered, for a DTensor), and this rank's part of the
    result."""
    if not hasattr(u, "device_mesh"):
        return orthogonalize(u).to(u.dtype)
    from torch.distributed.tensor import distribute_tensor

    whole = orthogonalize(u.full_tensor()).to(u.dtype)
    # Every rank holds the same whole result, so each keeps its part without communicating.
    return distribute_tensor(whole, u.device_mesh, u.placements, src_data_rank=None)
