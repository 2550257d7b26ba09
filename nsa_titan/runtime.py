"""Where this process runs: rank, world size, device and compute dtype."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from components.errors import UserError
from nsa_titan.checkout_hints import launch_several, per_node


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: compute in the parameters' dtype (fp32)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def launch_world() -> tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun set them; one process when launched directly."""
    values = []
    for name, default, low in (("RANK", 0, 0), ("LOCAL_RANK", 0, 0), ("WORLD_SIZE", 1, 1)):
        text = os.environ.get(name, str(default))
        if not (text.strip().isdigit() and int(text) >= low):
            raise UserError(f"the environment variable {name} = {text!r} is not a whole number >= {low}; the "
                            f"launcher (torchrun, run_train.sh) sets it. Fix: unset it to run one process, or "
                            f"launch several with {launch_several()}.")
        values.append(int(text))
    rank, local_rank, world_size = values
    if rank >= world_size:
        raise UserError(f"RANK = {rank} is not below WORLD_SIZE = {world_size} in the environment. Fix: unset both "
                        f"to run one process, or launch several with {launch_several()}.")
    return rank, local_rank, world_size


def check_launched(world_size: int) -> None:
    """A training process of several was started by a launcher, which sets more than WORLD_SIZE (which
    --print-config and doctor read alone, as the size of a launch to check a recipe for)."""
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if world_size > 1 and missing:  # a WORLD_SIZE left in the shell
        raise UserError(f"WORLD_SIZE = {world_size} is set in the environment but {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not, so no launcher started this process. Fix: "
                        f"unset WORLD_SIZE to run one process, or launch several with {launch_several()}.")


def uses_cuda(device_choice: str, processes_per_node: int) -> bool:
    """Whether training.device puts the ranks on GPUs here, refusing a device this node cannot give each of its
    processes (the launcher asks once for the node before starting them; each rank asks again for itself)."""
    has_cuda = torch.cuda.is_available()
    if device_choice == "cuda" and not has_cuda:
        raise UserError("training.device = 'cuda' but no CUDA device is visible. Fix: set "
                        "--training.device=cpu (or auto), or run on a machine with a GPU.")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and has_cuda)
    if use_cuda and processes_per_node > torch.cuda.device_count():
        raise UserError(f"{processes_per_node} processes on this node but {torch.cuda.device_count()} GPU(s) "
                        f"visible: local rank {torch.cuda.device_count()} would have no GPU of its own. Fix: launch "
                        f"at most that many processes per node ({per_node()}), or make more GPUs visible "
                        f"(CUDA_VISIBLE_DEVICES).")
    return use_cuda


def make_runtime(device_choice: str, dtype_choice: str) -> Runtime:
    rank, local_rank, world_size = launch_world()
    use_cuda = uses_cuda(device_choice, int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)))
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dtype_choice == "bfloat16" or (dtype_choice == "auto" and use_cuda):
        autocast_dtype = torch.bfloat16
    else:
        autocast_dtype = None
    return Runtime(rank, local_rank, world_size, device, autocast_dtype)
