"""Checks of a checkpoint before it is loaded, so that a bad one gets a message, not a traceback.

Both read only DCP's metadata file (sizes and byte ranges), never the tensors:
- `truncated_shards`: a shard file shorter than the byte ranges the metadata says it holds (a copy
  or a save cut short);
- `shape_mismatches`: tensors this run expects that the checkpoint lacks or holds in another shape
  (a resume after changing the model or the optimizer).
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.metadata import Metadata


def truncated_shards(model_dir: str, metadata: Metadata) -> list[tuple[str, str]]:
    """(file, what is wrong) for every shard file missing or shorter than its recorded contents."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = os.path.join(model_dir, name)
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have is None:
            problems.append((path, "is missing"))
        elif have < size:
            problems.append((path, f"is cut short ({have} bytes, the metadata records {size})"))
    return problems


def tensor_shapes(state: dict, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """The tensor leaves of a nested state dict under DCP's flattened names ('model.layers.0.w')."""
    shapes = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            shapes.update(tensor_shapes(value, name + "."))
        elif isinstance(value, torch.Tensor):
            shapes[name] = tuple(value.shape)  # a DTensor's shape is the global one, as saved
    return shapes


def shape_mismatches(expected: dict[str, tuple[int, ...]], metadata: Metadata) -> list[str]:
    """Differences between the tensors this run loads and those saved, in the run's order; tensors
    saved but not expected count under the prefixes ('model.', ...) this run loads."""
    saved = {name: tuple(md.size) for name, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}
    found = []
    for name, shape in expected.items():
        if name not in saved:
            found.append(f"{name} {list(shape)} is not in the checkpoint")
        elif saved[name] != shape:
            found.append(f"{name} is {list(saved[name])} in the checkpoint but {list(shape)} here")
    roots = {name.split(".", 1)[0] for name in expected}
    found += [f"{name} {list(shape)} is in the checkpoint but not here" for name, shape in saved.items()
              if name not in expected and name.split(".", 1)[0] in roots]
    return found
