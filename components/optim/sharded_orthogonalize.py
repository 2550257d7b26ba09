"""Orthogonalize many row-sharded matrices, each rank of the shard group computing its share of them.

Muon's update of a matrix needs the whole matrix. With FSDP2 every rank holds a block of rows of each
(a DTensor sharded on dim 0 over one mesh dimension, replicated over any other). Gathering every
matrix whole on every rank would repeat every iteration S times and move S times the data. Instead,
matrices are dealt out in turns, largest first, matrix j of a turn to the group's rank j:

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


def orthogonalize_each(grads: list[torch.Tensor], update_of: Callable[[int], torch.Tensor],
                       orthogonalize: Orthogonalize, apply: Callable[[int, torch.Tensor], None]) -> None:
    """For each i, apply(i, orthogonalize(the whole of update_of(i))) in the update's dtype and layout: a
    DTensor's result is a DTensor of the same placements (this rank's rows), a tensor's a tensor.

    grads[i] has the layout of update i. update_of(i) is called once for each i, when it is needed, and a
    result is applied as soon as it is ready, so only one turn's matrices are held at a time. Which path a
    matrix takes depends on its layout alone, the same on every rank, so every rank joins the same
    collectives."""
    by_group: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        layout = _row_shard_group(g)
        if layout is None:
            apply(i, _whole_then_like(update_of(i), orthogonalize))
        else:
            by_group.setdefault(layout, []).append(i)
    for (mesh, dim, _), indices in by_group.items():
        _dealt_out(mesh, dim, largest_first(indices, [grads[i].shape for i in indices]), update_of, orthogonalize,
                   apply)


def largest_first(indices: list[int], shapes: list[torch.Size]) -> list[int]:
    """`indices` ordered by the cost of orthogonalizing each matrix (rows x cols x the smaller of the
    two, Newton-Schulz's matmuls), largest first, ties in the given order. A turn lasts as long as its
    costliest matrix, so turns of like-sized matrices waste least: in parameter order a turn would pair
    an MLP matrix with a small KV projection, and every rank would wait on the MLP one."""
    def cost(k: int) -> int:
        rows, cols = shapes[k]
        return rows * cols * min(rows, cols)

    return [indices[k] for k in sorted(range(len(indices)), key=lambda k: -cost(k))]


def _row_shard_group(g: torch.Tensor) -> tuple | None:
    """(mesh, mesh dimension, dtype) when `g` is a 2-D DTensor whose rows are sharded over that one mesh
    dimension (the others replicated); else None. Placements, shape and dtype only: every rank decides
    alike."""
    if not hasattr(g, "device_mesh") or g.ndim != 2 or g.device_mesh.ndim != len(g.placements):
        return None
    sharded = [d for d, p in enumerate(g.placements) if not p.is_replicate()]
    if len(sharded) != 1:
        return None
    placement = g.placements[sharded[0]]
    if type(placement).__name__ != "Shard" or placement.dim != 0:  # not a strided or other special shard
        return None
    return g.device_mesh, sharded[0], g.dtype


def _row_counts(rows: int, parts: int) -> list[int]:
    """Rows per rank as torch.chunk (and DTensor's Shard) split them: full chunks first, then what is left."""
    counts = [len(c) for c in torch.arange(rows).chunk(parts)]
    return counts + [0] * (parts - len(counts))


def _dealt_out(mesh, dim: int, indices: list[int], update_of, orthogonalize: Orthogonalize, apply) -> None:
    """The matrices `indices` dealt out over the group's ranks in turns; each rank applies its rows of each."""
    group, me, size = mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim)
    for start in range(0, len(indices), size):
        turn = indices[start:start + size]  # matrix j of the turn is rank j's to compute
        updates = [update_of(i) for i in turn]
        locals_ = [u.to_local() for u in updates]
        rows = [_row_counts(u.shape[0], size) for u in updates]
        for local, counts in zip(locals_, rows):
            if local.shape[0] != counts[me]:
                raise RuntimeError(f"a sharded matrix's rows are not split as torch.chunk splits them "
                                   f"({local.shape[0]} rows here, {counts[me]} expected): Muon cannot put it together")
        if size == 1:  # the whole matrix is here (FSDP2 on a mesh of one rank)
            for i, u, local in zip(turn, updates, locals_):
                apply(i, _from_local(orthogonalize(local).to(local.dtype).contiguous(), u))
            continue
        owns = me < len(turn)
        # 1. my rows of matrix j go to rank j; I get every rank's rows of my matrix
        sent = [locals_[j].numel() if j < len(turn) else 0 for j in range(size)]
        got = [rows[me][s] * updates[me].shape[1] for s in range(size)] if owns else [0] * size
        parts = _exchange(torch.cat([t.contiguous().flatten() for t in locals_]), sent, got, group)
        # 2. my matrix, whole, orthogonalized, cut back into the ranks' rows
        if owns:
            whole = parts.view(updates[me].shape)
            back = orthogonalize(whole).to(whole.dtype).contiguous().flatten()
        else:
            back = locals_[0].new_empty(0)
        # 3. rank j's result comes back to me as my rows of matrix j
        results = _exchange(back, got, sent, group)
        for i, u, local, mine in zip(turn, updates, locals_, torch.split(results, sent[:len(turn)])):
            apply(i, _from_local(mine.view(local.shape), u))


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
