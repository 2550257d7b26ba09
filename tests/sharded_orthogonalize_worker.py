"""Run under torch.distributed.run by tests/test_optim_muon.py: matrices sharded by rows as FSDP2 shards
them (DTensor, Shard(0)), some with fewer rows than ranks and of several shapes, orthogonalized by
orthogonalize_each: each rank's result is its rows of the whole matrix's result, to the bit, and each rank
ran only its share of the iterations. A 2-D mesh (replicate x shard, as HSDP) too.

argv: mesh ("1d" | "2d"). Prints "ok <iterations run>" per rank on success."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from components.optim.muon import orthogonalized
from components.optim.sharded_orthogonalize import largest_first, orthogonalize_each

SHAPES = [(8, 5), (3, 7), (64, 16), (1, 4), (16, 64), (10, 10), (5, 3)]


def main(layout: str) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if layout == "1d":
        mesh, placements = init_device_mesh("cpu", (world,)), [Shard(0)]
    else:
        mesh, placements = init_device_mesh("cpu", (2, world // 2)), [Replicate(), Shard(0)]
    gen = torch.Generator().manual_seed(0)
    wholes = [torch.randn(*shape, generator=gen) for shape in SHAPES]  # the same on every rank
    sharded = [distribute_tensor(w, mesh, placements, src_data_rank=None) for w in wholes]
    runs = []

    def counted(whole):
        runs.append(whole.shape)
        return orthogonalized(whole, 5)

    results, asked = {}, []

    def update_of(i):
        asked.append(i)
        return sharded[i]

    orthogonalize_each(sharded, update_of, counted, results.__setitem__)
    assert sorted(asked) == list(range(len(SHAPES))) and sorted(results) == sorted(asked)  # once each, each applied
    assert asked == largest_first(list(range(len(SHAPES))), [torch.Size(s) for s in SHAPES]), asked  # turns of like size
    for whole, got, want_layout in zip(wholes, [results[i] for i in range(len(SHAPES))], sharded):
        expected = distribute_tensor(orthogonalized(whole, 5).to(whole.dtype), mesh, placements, src_data_rank=None)
        assert got.placements == want_layout.placements and got.shape == whole.shape
        assert torch.equal(got.to_local(), expected.to_local()), (whole.shape, got.to_local(), expected.to_local())
        assert torch.equal(got.full_tensor(), orthogonalized(whole, 5).to(whole.dtype))
    shard_group = mesh.size(len(placements) - 1)
    assert len(runs) <= -(-len(SHAPES) // shard_group), runs  # its share, not every matrix
    plain = {}
    orthogonalize_each([wholes[0]], lambda i: wholes[0], counted, plain.__setitem__)  # a plain tensor: whole, here
    assert torch.equal(plain[0], orthogonalized(wholes[0], 5))
    print(f"rank {dist.get_rank()}: ok {len(runs) - 1}")
    # Gloo's worker threads free a finished collective's tensors after the caller has moved on, taking the
    # GIL to do so; one still freeing when the interpreter shuts down aborts the process. A barrier waits
    # (GIL released) until every rank is done, which gives them that time, as the trainer's exit does.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
