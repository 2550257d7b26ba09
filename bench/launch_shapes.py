"""Launch shapes files: kernel shapes to use in place of the shipped ones (tile_configs.py) for one run.

bench.tile_choice writes one from bench.tile_variants' measurements; bench.attention and
bench.attention_stages take it as --tiles FILE, the test suite as --nsa-tiles FILE (tests/conftest.py),
so a shape can be timed and held to the GPU tests before it is written into tile_configs.py, where
training reads it. The file is tile_choice's report; what is read from it is its "shapes" list:

    {"shapes": [{"kernel": "interval_dkdv", "head_block": 128, "element_bytes": 2, "tiles": [32, 64, 8, 2]}, ...]}

head_block is a padded head dim with a shape of its own (32, 64, 128, 256), element_bytes 2 (bf16,
fp16) or 4 (fp32), tiles (rows, keys, warps, stages) as tile_configs.Tiles.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack, contextmanager
from typing import Iterator, NamedTuple

from components.nsa.triton import tile_configs
from components.nsa.triton.tile_configs import HEAD_BLOCKS, KERNELS, Tiles


class LaunchShape(NamedTuple):
    kernel: str
    head_block: int
    element_bytes: int
    tiles: Tiles

    def as_json(self) -> dict:
        return {"kernel": self.kernel, "head_block": self.head_block, "element_bytes": self.element_bytes,
                "tiles": list(self.tiles)}


class ShapesFileError(ValueError):
    """A launch shapes file that cannot be used; the message names the file, the problem and the fix."""


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def shape_problem(kernel, head_block, element_bytes, tiles) -> str | None:
    """What is wrong with one entry, or None."""
    if kernel not in KERNELS:
        return f"kernel {kernel!r} is none of {', '.join(KERNELS)}"
    if head_block not in HEAD_BLOCKS:
        return f"head_block {head_block!r} is none of {', '.join(map(str, HEAD_BLOCKS))}"
    if element_bytes not in (2, 4):
        return f"element_bytes {element_bytes!r} is neither 2 (bf16, fp16) nor 4 (fp32)"
    if not (isinstance(tiles, list) and len(tiles) == 4 and all(type(x) is int for x in tiles)):
        return f"tiles {tiles!r} is not four whole numbers (rows, keys, warps, stages)"
    rows, keys, warps, stages = tiles
    shipped = tile_configs.tiles(kernel, head_block, element_bytes)
    for name, value, own in (("rows", rows, shipped.rows), ("keys", keys, shipped.keys)):
        if own == 0 and value != 0:  # 0: the launcher sizes it from the call (tile_configs' table says which)
            return f"{name} {value} where {kernel} takes 0 (its launcher sizes them)"
        if own != 0 and not (_power_of_two(value) and value >= 16):
            return f"{name} {value} is not a power of two of at least 16"
    if warps not in (1, 2, 4, 8, 16):
        return f"warps {warps} is not a power of two from 1 to 16"
    if not 1 <= stages <= 8:
        return f"stages {stages} is not from 1 to 8"
    return None


def read_shapes(path: str) -> list[LaunchShape]:
    """The shapes of a launch shapes file; ShapesFileError naming what is wrong."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ShapesFileError(f"launch shapes file {path}: cannot read it ({exc.strerror or exc}); give the file "
                              f"bench.tile_choice wrote") from None
    except ValueError as exc:
        raise ShapesFileError(f"launch shapes file {path}: not JSON ({exc}); give the file bench.tile_choice "
                              f"wrote") from None
    entries = data.get("shapes") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ShapesFileError(f"launch shapes file {path}: no 'shapes' list; give the file bench.tile_choice wrote")
    shapes, seen = [], set()
    for i, entry in enumerate(entries):
        fields = ("kernel", "head_block", "element_bytes", "tiles")
        if not isinstance(entry, dict) or set(entry) != set(fields):
            raise ShapesFileError(f"launch shapes file {path}: shapes[{i}] must hold exactly {', '.join(fields)}")
        problem = shape_problem(*(entry[f] for f in fields))
        if problem:
            raise ShapesFileError(f"launch shapes file {path}: shapes[{i}]: {problem}")
        key = (entry["kernel"], entry["head_block"], entry["element_bytes"])
        if key in seen:
            raise ShapesFileError(f"launch shapes file {path}: shapes[{i}] gives {key[0]} at head_block {key[1]}, "
                                  f"element_bytes {key[2]} a second time; keep one")
        seen.add(key)
        shapes.append(LaunchShape(*key, Tiles(*entry["tiles"])))
    return shapes


@contextmanager
def applied(shapes: list[LaunchShape]) -> Iterator[None]:
    """Launch with `shapes` in place of the shipped ones until the block ends."""
    with ExitStack() as stack:
        for s in shapes:
            stack.enter_context(tile_configs.overridden(s.kernel, s.head_block, s.element_bytes, s.tiles))
        yield


def add_tiles_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiles", metavar="FILE",
                   help="launch the kernels with the shapes of this file (bench.tile_choice writes it) instead of "
                        "the shipped ones")


def finish_tiles_arg(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """args.shapes: --tiles FILE's shapes ([] without it); argparse's usage error for a file that cannot be used."""
    try:
        args.shapes = read_shapes(args.tiles) if args.tiles else []
    except ShapesFileError as exc:
        p.error(str(exc))
    return args


def config_of(args: argparse.Namespace) -> dict:
    """A benchmark's arguments for its report, the shapes it launched with written out."""
    config = {k: v for k, v in vars(args).items() if k != "shapes"}
    config["launch_shapes"] = [s.as_json() for s in args.shapes]
    return config


def describe(shapes: list[LaunchShape]) -> str:
    """One line: 'interval_dkdv (D 128, 2 B) 32,64,8,2; ...', or 'the shipped shapes'."""
    if not shapes:
        return "the shipped shapes"
    return "; ".join(f"{s.kernel} (D {s.head_block}, {s.element_bytes} B) {','.join(map(str, s.tiles))}"
                     for s in shapes)
