"""Checks of a checkpoint before it is loaded, so that a bad one gets a message, not a traceback.

Two read only DCP's metadata file (sizes and byte ranges), never the tensors:
- `truncated_shards`: a shard file shorter than the byte ranges the metadata says it holds (a copy
  or a save cut short);
- `shape_mismatches`: tensors this run expects that the checkpoint lacks or holds in another shape
  (a resume after changing the model or the optimizer).
And one reads every byte: `changed_files` holds the files to the sizes and CRC-32 checksums recorded
when they were written (`file_checksum`), so a file damaged in place is found before it is loaded.
"""

from __future__ import annotations

import os
import zlib

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


_CHUNK = 16 * 2**20


def file_checksum(path: str) -> list[int]:
    """[size, CRC-32] of a file, read in chunks (about 4 GB/s: small beside writing it)."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return [size, crc]


def changed_files(folder: str, recorded: dict[str, list[int]]) -> list[tuple[str, str]]:
    """(file, what is wrong) for every file of `recorded` (relative path -> [size, CRC-32] at save) that
    is gone, has another size or other bytes now."""
    problems = []
    for name, (size, crc) in sorted(recorded.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append((path, "is missing"))
            continue
        try:
            have = file_checksum(path)
        except OSError as exc:  # a failing disk: a finding like the others (every rank must reach the gather)
            problems.append((path, f"cannot be read ({exc.strerror or exc})"))
            continue
        if have[0] != size:
            problems.append((path, f"is {have[0]} bytes, but the save wrote {size}"))
        elif have[1] != crc:
            problems.append((path, "holds other bytes than the save wrote (its checksum differs: the file was "
                                   "changed or damaged after the save)"))
    return problems
