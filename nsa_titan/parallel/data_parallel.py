"""Data parallelism with FSDP2: fully sharded, hybrid (HSDP) or replicated (DDP).

All three use `fully_shard` over a 2-D (replicate, shard) mesh:
- shard > 1, replicate == 1: FSDP, parameters and optimizer state sharded over all ranks;
- shard > 1, replicate > 1: HSDP, sharded inside a group, replicated across groups;
- shard == 1: DDP, parameters replicated, gradients all-reduced.
One mechanism means one kind of parameter (DTensor) for clipping and checkpoints in every layout,
so a checkpoint written by one layout loads into any other.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from components.model_hooks import ParallelPlan
from nsa_titan.parallel.distributed import SHARD


def _reshard_after_forward(choice: str, shard_degree: int) -> bool:
    if choice == "always":
        return True
    if choice == "never":
        return False
    return shard_degree > 1  # with nothing sharded there is nothing to free


def apply_data_parallel(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, *, param_dtype: torch.dtype | None,
                        reshard_after_forward: str) -> None:
    """Wrap each block of the model part's plan, then its groups, then the root (the model itself).

    A group marked keep_gathered runs last in forward (e.g. the output layer): keeping it gathered
    saves an all-gather right before backward.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = _reshard_after_forward(reshard_after_forward, mesh[SHARD].size())
    for block in plan.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    for group in plan.groups:
        modules = group.modules[0] if len(group.modules) == 1 else list(group.modules)
        fully_shard(modules, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard and not group.keep_gathered)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def set_gradient_sync(model: nn.Module, mesh: DeviceMesh | None, last_micro_batch: bool) -> None:
    """Skip communication that gradient accumulation does not need before the last micro-batch.

    Replicated parameters (DDP) accumulate locally and all-reduce once. With HSDP the cross-group
    all-reduce waits for the last micro-batch; the reduce-scatter inside a group still runs each
    time, since skipping it would keep unsharded gradients in memory.
    """
    if mesh is None or not isinstance(model, FSDPModule):
        return
    if mesh[SHARD].size() == 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(last_micro_batch, recurse=False)
    else:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_all_reduce(last_micro_batch, recurse=False)
