"""Process group and device mesh: gloo on CPU and NCCL on CUDA from the same code."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.errors import UserError
from nsa_titan.runtime import Runtime

REPLICATE, SHARD, CONTEXT = "dp_replicate", "dp_shard", "cp"


def init_process_group(runtime: Runtime, start_up_seconds: float, single_process: bool = False) -> None:
    """Join the job: every rank meets every other within `start_up_seconds`, or the start fails naming the ranks
    that did not come (_meet). Collectives wait that long too until set_collective_timeout. One process joins
    nothing unless `single_process` asks for a group of its own (FSDP2 on a mesh of one rank)."""
    if (runtime.world_size == 1 and not single_process) or dist.is_initialized():
        return
    backend = "nccl" if runtime.device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=start_up_seconds)
    kwargs = {"device_id": runtime.device} if runtime.device.type == "cuda" else {}
    if runtime.world_size == 1:  # no launcher to meet: an in-memory store
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    else:
        kwargs.update(store=_meet(runtime, timeout), rank=runtime.rank, world_size=runtime.world_size)
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)


def _meet(runtime: Runtime, timeout: timedelta) -> dist.Store:
    """The launch's store once every rank has reached it, within `timeout`. NCCL's communicator set-up (eager, with
    device_id) waits for a missing rank without any bound, and gloo's names none: the ranks meet here first."""
    store, _, _ = next(dist.rendezvous("env://", runtime.rank, runtime.world_size, timeout=timeout))
    store.set_timeout(timeout)
    # A launcher's store outlives a restart of its workers (torchrun --max-restarts): each attempt meets anew.
    prefix = f"nsa_titan/start/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/rank/{runtime.rank}", "1")
    if store.add(f"{prefix}/joined", 1) == runtime.world_size:
        store.set(f"{prefix}/all", "1")
    try:
        store.wait([f"{prefix}/all"], timeout)
    except RuntimeError:  # the store's timeout (DistStoreError)
        missing = [r for r in range(runtime.world_size) if not store.check([f"{prefix}/rank/{r}"])]
        shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UserError(
            f"rank(s) {shown} of {runtime.world_size} did not start within parallelism.init_timeout_seconds = "
            f"{timeout.total_seconds():g} s (this is rank {runtime.rank}). Fix: look at the missing ranks' own output "
            f"(a node still starting, a stuck import or file system, a crash before the start), or raise "
            f"parallelism.init_timeout_seconds where ranks start this slowly.") from None
    return store


UNWATCHED_COLLECTIVE_SECONDS = 24 * 3600  # what a collective may wait where no watchdog limit bounds a step


def collective_seconds(step_timeout_s: float, first_step_timeout_s: float) -> float:
    """How long a collective may wait once the job has met: a minute past the watchdog's limits (fault.*), so that
    a hang is diagnosed with stack dumps before the communicator gives up; a day where a limit is 0 (off)."""
    return max(limit + 60 if limit > 0 else UNWATCHED_COLLECTIVE_SECONDS
               for limit in (step_timeout_s, first_step_timeout_s))


_collective_timeout: timedelta | None = None  # set_collective_timeout's, for groups made after it


def set_collective_timeout(seconds: float, *meshes: DeviceMesh | None) -> None:
    """From now on a collective of the job's group or of any dimension of these meshes that has not completed after
    `seconds` fails. A mesh dimension spanning less than the job has a group of its own, made with torch's default
    timeout (10 min on NCCL, 30 on gloo), not the job's."""
    global _collective_timeout
    if not dist.is_initialized():
        return
    _collective_timeout = timedelta(seconds=seconds)
    groups = {id(g): g for mesh in meshes if mesh is not None for g in mesh.get_all_groups()}
    groups[id(dist.group.WORLD)] = dist.group.WORLD
    for group in groups.values():
        # Private, in torch since 2.2 (the only way to change a live group's timeout); the meeting at
        # start-up keeps its own, shorter wait.
        dist.distributed_c10d._set_pg_timeout(_collective_timeout, group)


BACKGROUND_COLLECTIVE_SECONDS = 1800  # torch's gloo default: a background group's least wait


def new_group_for_background_work(backend: str) -> dist.ProcessGroup:
    """A group of every rank on `backend` for work beside training (an async save's gather): its waits are ranks
    waiting for a slow rank's background writes while training steps on, which the watchdog never sees, so the
    collective timeout (set_collective_timeout) holds it only where that is longer than 30 min."""
    seconds = max(BACKGROUND_COLLECTIVE_SECONDS, _collective_timeout.total_seconds() if _collective_timeout else 0)
    return dist.new_group(backend=backend, timeout=timedelta(seconds=seconds))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def build_mesh(runtime: Runtime, replicate: int, shard: int, context: int = 1,
               single_process: bool = False) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(the (replicate, shard) mesh FSDP2 works on, the context-parallel mesh or None).

    With context parallelism the ranks form a (replicate, shard, cp) mesh, cp varying fastest (the
    ranks of a cp group are neighbours, on one node when they fit); FSDP2 shards over shard x cp
    flattened into the mesh's "dp_shard" dimension, as torchtitan does: a cp rank holds part of the
    sequence, not of the model, so it can hold part of the parameters instead of a copy."""
    if runtime.world_size == 1 and not single_process:
        return None, None
    if context == 1:
        return init_device_mesh(runtime.device.type, (replicate, shard), mesh_dim_names=(REPLICATE, SHARD)), None
    # Two meshes over the same ranks, both row-major: FSDP's "dp_shard" dimension holds shard x cp
    # consecutive ranks, and each cp group is cp consecutive ranks inside one of them.
    fsdp = init_device_mesh(runtime.device.type, (replicate, shard * context), mesh_dim_names=(REPLICATE, SHARD))
    groups = init_device_mesh(runtime.device.type, (replicate * shard, context), mesh_dim_names=("dp", CONTEXT))
    return fsdp, groups[CONTEXT]


def describe_data_parallel(mesh: DeviceMesh, context: int = 1) -> str:
    """The data-parallel layout in words, for the run's start line: DDP, FSDP or HSDP (all FSDP2 on the
    (replicate, shard) mesh; with context parallelism the shard dimension holds shard x cp ranks)."""
    replicate, shard = mesh.shape
    over = f"{shard} ranks" if context == 1 else f"{shard} ranks = {shard // context} x {context} context-parallel"
    if shard == 1:
        return f"DDP over {replicate} replicas" if replicate > 1 else "FSDP2 on a mesh of one rank"
    if replicate == 1:
        return f"FSDP sharded over {over}"
    return f"HSDP: {replicate} replicas, each sharded over {over}"


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over all ranks (a no-op in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank: every rank gets the same answer, so all take the same branch
    (one that went into a collective alone would wait there)."""
    return all_reduce_mean(torch.tensor(float(flag), device=device)).item() > 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# What a collective raises on a rank whose peer has exited (gloo's sockets close; NCCL reports the remote
# process gone or its communicator aborted): the symptom of another rank's failure, which that rank
# reports itself. gloo words it by which of its threads meets the closed socket first: a read ("Connection
# closed by peer", "Connection reset by peer"), a write after the reset ("writev ...: Broken pipe"), or a
# socket already torn down ("Socket closed"). A backend's name must come with it: a download's "Connection
# reset by peer" is not this.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
              "communicator was aborted", "remote process exiting", "ncclRemoteError")
_BACKENDS = ("gloo", "NCCL", "nccl", "ProcessGroup")
# The exit code of a rank that stopped only because it lost a peer: the launcher looks past it for the cause.
PEER_LOST_EXIT_CODE = 5  # beside 2 (bad input), 3 (NaN stop), 4 (out of memory), 124 (hang)
# The NaN guard's stop: the one fault every rank decides together, at the same step.
NUMERICAL_FAULT_EXIT = 3


def lost_a_peer(exc: BaseException) -> str | None:
    """What in `exc` (a collective's error) says a peer rank is gone ('Connection reset by peer', ...), or None."""
    text = str(exc)
    if not (isinstance(exc, dist.DistError) or any(name in text for name in _BACKENDS)):
        return None
    return next((marker for marker in _PEER_GONE if marker in text), None)
