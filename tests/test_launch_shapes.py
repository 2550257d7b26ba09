"""Launch shapes files (bench/launch_shapes.py): read and checked with one clear message per problem, applied
for a block and put back after, taken by the benchmarks' --tiles and the test suite's --nsa-tiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.launch_shapes import LaunchShape, ShapesFileError, applied, read_shapes
from components.nsa.triton import tile_configs
from components.nsa.triton.tile_configs import Tiles

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, data, name="shapes.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _entry(**changes):
    return {"kernel": "interval_dkdv", "head_block": 128, "element_bytes": 2, "tiles": [32, 64, 8, 2], **changes}


def test_a_file_is_read_and_applied_for_the_block_only(tmp_path):
    path = _write(tmp_path, {"benchmark": "tile_choice", "shapes": [_entry(), _entry(kernel="selected_fwd",
                                                                                     tiles=[0, 32, 4, 3])]})
    shapes = read_shapes(path)
    assert shapes == [LaunchShape("interval_dkdv", 128, 2, Tiles(32, 64, 8, 2)),
                      LaunchShape("selected_fwd", 128, 2, Tiles(0, 32, 4, 3))]
    shipped = [tile_configs.tiles(s.kernel, 128, 2) for s in shapes]
    with applied(shapes):
        assert [tile_configs.tiles(s.kernel, 128, 2) for s in shapes] == [s.tiles for s in shapes]
        assert tile_configs.tiles("interval_dkdv", 128, 4) == tile_configs._FP32["interval_dkdv"][128]  # fp32 kept
    assert [tile_configs.tiles(s.kernel, 128, 2) for s in shapes] == shipped


@pytest.mark.parametrize("data, message", [
    ("{not json", "not JSON"),
    ([1, 2], "no 'shapes' list"),
    ({"shapes": [{"kernel": "interval_dkdv"}]}, "shapes[0] must hold exactly kernel, head_block, element_bytes, tiles"),
    ({"shapes": [_entry(kernel="interval_bwd")]}, "kernel 'interval_bwd' is none of interval_fwd"),
    ({"shapes": [_entry(head_block=96)]}, "head_block 96 is none of 32, 64, 128, 256"),
    ({"shapes": [_entry(element_bytes=1)]}, "element_bytes 1 is neither 2"),
    ({"shapes": [_entry(tiles=[32, 64, 8])]}, "is not four whole numbers"),
    ({"shapes": [_entry(tiles=[32, 64.0, 8, 2])]}, "is not four whole numbers"),
    ({"shapes": [_entry(tiles=[24, 64, 8, 2])]}, "rows 24 is not a power of two of at least 16"),
    ({"shapes": [_entry(tiles=[32, 8, 8, 2])]}, "keys 8 is not a power of two of at least 16"),
    ({"shapes": [_entry(kernel="selection", tiles=[64, 32, 8, 1])]}, "keys 32 where selection takes 0"),
    ({"shapes": [_entry(tiles=[32, 64, 3, 2])]}, "warps 3 is not a power of two from 1 to 16"),
    ({"shapes": [_entry(tiles=[32, 64, 8, 0])]}, "stages 0 is not from 1 to 8"),
    ({"shapes": [_entry(), _entry(tiles=[32, 32, 8, 1])]}, "shapes[1] gives interval_dkdv at head_block 128, "
                                                           "element_bytes 2 a second time"),
])
def test_a_bad_file_is_refused_with_what_is_wrong(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(ShapesFileError) as error:
        read_shapes(path)
    assert message in str(error.value) and path in str(error.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ShapesFileError, match="cannot read it"):
        read_shapes(str(tmp_path / "absent.json"))


@pytest.mark.parametrize("module", ["attention", "attention_stages"])
def test_the_op_benchmarks_take_a_file_and_refuse_a_bad_one(tmp_path, module, capsys):
    import importlib

    from bench.launch_shapes import config_of

    bench = importlib.import_module(f"bench.{module}")
    args = bench.parse_args(["--tiles", _write(tmp_path, {"shapes": [_entry()]})])
    assert args.shapes == [LaunchShape("interval_dkdv", 128, 2, Tiles(32, 64, 8, 2))]
    config = config_of(args)
    assert config["launch_shapes"] == [_entry()] and "shapes" not in config
    json.dumps(config)  # the report's config stays plain JSON
    assert bench.parse_args([]).shapes == []
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--tiles", _write(tmp_path, {"shapes": [_entry(head_block=100)]}, "bad.json")])
    assert stop.value.code == 2
    assert "head_block 100 is none of" in capsys.readouterr().err


def test_kernel_resources_compiles_a_files_shapes(tmp_path, monkeypatch):
    """A candidate's registers and spills, offline: the kernels compile with the file's shapes, the shipped ones
    are back afterwards, and the report records the shapes it compiled."""
    from bench import kernel_resources

    seen = []
    monkeypatch.setattr(kernel_resources, "interpreting", lambda: False)
    monkeypatch.setattr(kernel_resources, "compile_one",
                        lambda *args: seen.append(tile_configs.tiles("interval_dkdv", 128, 2)) or [])
    shipped = tile_configs.tiles("interval_dkdv", 128, 2)
    out = tmp_path / "kernels.json"
    path = _write(tmp_path, {"shapes": [_entry()]})
    assert kernel_resources.main(["--head-dims", "128", "--tiles", path, "--json", str(out)]) == 0
    assert seen == [Tiles(32, 64, 8, 2)] and tile_configs.tiles("interval_dkdv", 128, 2) == shipped
    assert json.loads(out.read_text())["arguments"]["launch_shapes"] == [_entry()]


def _pytest_with_tiles(tmp_path, *tiles_args):
    probe = tmp_path / "test_probe.py"
    probe.write_text("from components.nsa.triton import tile_configs\n\n"
                     "def test_shape():\n"
                     "    assert tuple(tile_configs.tiles('interval_dq', 64, 2)) == (64, 16, 4, 1)\n")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *tiles_args, str(probe)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_suite_launches_with_nsa_tiles_and_refuses_a_bad_file(tmp_path):
    """What the GPU suite's check phase passes to pytest: every test runs with the file's shapes."""
    good = _write(tmp_path, {"shapes": [_entry(kernel="interval_dq", head_block=64, tiles=[64, 16, 4, 1])]})
    proc = _pytest_with_tiles(tmp_path, "--nsa-tiles", good)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"NSA launch shapes from {good}: interval_dq (D 64, 2 B) 64,16,4,1" in proc.stdout
    assert _pytest_with_tiles(tmp_path).returncode == 1  # without the option, the shipped shape
    bad = _write(tmp_path, {"shapes": [_entry(stages=2)]}, "bad.json")
    proc = _pytest_with_tiles(tmp_path, "--nsa-tiles", bad)
    assert proc.returncode == 4 and "shapes[0] must hold exactly" in proc.stderr, proc.stderr
