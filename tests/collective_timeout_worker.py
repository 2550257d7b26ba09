"""Run under torch.distributed.run (4 ranks, gloo) by tests/test_collective_timeout.py. The job meets with a 60 s
start-up timeout; set_collective_timeout(2 s) then covers the job's group and an HSDP mesh's groups (each dimension
a group of 2 ranks of its own); a background group made after it keeps at least 30 min. Every rank prints its
groups' timeouts; rank 0 then waits in an all-reduce over its shard group, which rank 1 never joins, and prints how
long it waited before failing."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from components.errors import UserError
from nsa_titan.parallel.distributed import (build_mesh, init_process_group, new_group_for_background_work,
                                            set_collective_timeout)
from nsa_titan.runtime import Runtime


def timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def a_rank_never_starts(runtime: Runtime) -> None:
    """argv "late": rank 1 never joins; the others' start fails after 3 s naming it."""
    if runtime.rank == 1:
        time.sleep(12)  # alive, never joining, until the others have given up
        os._exit(0)
    began = time.monotonic()
    try:
        init_process_group(runtime, 3)
        said = "joined"
    except UserError as exc:
        said = str(exc)
    os.write(1, f"rank {runtime.rank} after {time.monotonic() - began:.1f} s: {said}\n".encode())
    os._exit(0)


if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    runtime = Runtime(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"), autocast_dtype=None)
    if sys.argv[1:] == ["late"]:
        a_rank_never_starts(runtime)
    init_process_group(runtime, 60)
    start_up = timeout_s(dist.group.WORLD)
    mesh, _ = build_mesh(runtime, 2, 2)
    set_collective_timeout(2, mesh)
    later = new_group_for_background_work("gloo")
    said = [f"start-up {start_up:g}", f"world {timeout_s(dist.group.WORLD):g}",
            *(f"{name} {timeout_s(mesh.get_group(name)):g}" for name in mesh.mesh_dim_names),
            f"new {timeout_s(later):g}"]
    os.write(1, f"rank {rank}: {', '.join(said)}\n".encode())  # one write: the ranks share the pipe
    if rank == 0:
        began = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=mesh.get_group("dp_shard"))
            result = "completed"
        except RuntimeError as exc:
            result = str(exc).splitlines()[0]
        os.write(1, f"rank 0 waited {time.monotonic() - began:.1f} s: {result}\n".encode())
    else:
        time.sleep(12)  # alive, never joining: rank 0's wait ends by its timeout, not a closed connection
    os._exit(0)
