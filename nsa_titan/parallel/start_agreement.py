"""What every rank of a job must share before it trains, checked once at start-up, on every rank alike.

Each node of a multi-node job is launched on its own (run_train.sh with NNODES), so nothing else makes its
ranks run one recipe or write one folder: nodes given different overrides trained apart without a word,
hung when their step counts differed, or failed inside a collective; a dump folder local to each node saved
checkpoints whose files lay on several machines.
"""

from __future__ import annotations

import os
import socket
import uuid

import torch.distributed as dist

from components.errors import UserError

_PROBE = ".every-rank-sees-this"  # in the dump folder while the ranks look; removed after


def _gather(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _broadcast(value, src: int):
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _several_ranks() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def refuse_other_recipes(recipe_hash: str, recipe_toml: str, differences) -> None:
    """Every rank runs the recipe of rank 0, else every rank raises the same UserError naming the first rank
    that differs, its host and the fields (`differences(toml_a, toml_b)` -> ['field: a -> b', ...])."""
    if not _several_ranks():
        return
    seen = _gather((recipe_hash, socket.gethostname()))
    other = next((rank for rank, (found, _) in enumerate(seen) if found != seen[0][0]), None)
    if other is None:
        return
    first, theirs = _broadcast(recipe_toml, 0), _broadcast(recipe_toml, other)
    changed = "; ".join(differences(first, theirs)) or "the same fields, read by another version of the code"
    raise UserError(f"the ranks run different recipes: rank {other} (on {seen[other][1]}) differs from rank 0 (on "
                    f"{seen[0][1]}) in {changed}. Fix: launch every node with the same recipe, overrides and code.")


def refuse_unshared_folder(folder: str, is_main: bool) -> None:
    """Every rank sees the files rank 0 writes in `folder` (checkpoints are written by every rank, and read
    back whole), else every rank raises the same UserError naming a rank that does not."""
    if not _several_ranks():
        return
    probe = os.path.join(folder, _PROBE)
    token = uuid.uuid4().hex if is_main else None
    if is_main:
        with open(probe, "w", encoding="utf-8") as fh:
            fh.write(token)
    token = _broadcast(token, 0)
    try:
        with open(probe, encoding="utf-8") as fh:
            sees = fh.read() == token
    except OSError:
        sees = False
    seen = _gather((sees, socket.gethostname()))
    if is_main:
        os.remove(probe)
    blind = next((rank for rank, (ok, _) in enumerate(seen) if not ok), None)
    if blind is not None:
        raise UserError(f"job.dump_folder {folder!r} is not shared by every rank: rank {blind} (on {seen[blind][1]}) "
                        f"does not see the file rank 0 (on {seen[0][1]}) wrote there, so a checkpoint's files would "
                        f"lie on several machines. Fix: put job.dump_folder on a file system every node mounts, at "
                        f"the same path on each.")
