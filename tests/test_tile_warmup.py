"""bench.tile_warmup: the shapes a tile_variants run times, compiled first by several processes. What can be checked
without a GPU: the shorter length gives Triton's integer specializations the classes the real one has, the workers
share out every launch, and a run with workers measures what one without does."""

from __future__ import annotations

import json

import pytest
import torch

from bench import tile_variants, tile_warmup
from tests.test_bench_smoke import TINY_NSA


def _class(n: int) -> tuple[bool, bool]:
    """How Triton specializes an integer argument."""
    return n == 1, n % 16 == 0


@pytest.mark.parametrize("T", [65536, 32768, 131072, 65536 + 48, 20000, 8192, 2048, 100])
def test_the_warm_length_specializes_every_launch_count_as_the_real_one(T):
    W = tile_warmup.warm_length(T)
    assert W <= max(T, 2 * tile_warmup.WARM_MODULUS)
    for heads, D, batch in ((64, 128, 1), (12, 64, 32)):
        for count in (lambda t: t, lambda t: (t - 32) // 16 + 1, lambda t: -(-t // 64),  # tokens, blocks
                      lambda t: batch * t * heads * D, lambda t: ((t - 32) // 16 + 1) * 4 * D,  # strides
                      lambda t: batch * 4 * -(-t // 64), lambda t: batch * t * 4 * 16):  # selection lists
            assert _class(count(W)) == _class(count(T)), (T, W)


def test_decisions_the_launchers_make_from_the_length_are_kept():
    """The interval kernels run at the length itself: their dK/dV work split (per query head or per group, fp32
    partials or not) follows the number of key tiles, which the window branch of 64k rows with the paper's heads
    has past 1024 and a shorter length does not. The selected branch's kernels run shorter only where their layout
    comes out as at the length."""
    paper = tile_variants.parse_args(["--preset", "paper"])
    for kernel in ("interval_fwd", "interval_dq", "interval_dkdv"):
        assert tile_warmup.launch_length(kernel, 65536, paper, 2) == 65536
    for kernel in ("selection", "selected_fwd", "selected_dq", "selected_dkdv", "selected_fwd_blocks"):
        assert tile_warmup.launch_length(kernel, 65536, paper, 2) == tile_warmup.warm_length(65536) < 65536
    # The 125M heads (a group of 3) take the block layout at 64k and the query layout at 128k, past the partials'
    # limit: a shorter length would compile the block layout's kernels for nothing.
    small_groups = tile_variants.parse_args([])
    assert tile_warmup.launch_length("selected_dkdv", 65536, small_groups, 2) == tile_warmup.warm_length(65536)
    assert tile_warmup.launch_length("selected_dkdv", 131072, small_groups, 2) == 131072


def test_a_worker_still_running_at_the_limit_is_stopped(monkeypatch, capsys):
    import subprocess
    import time

    real = subprocess.Popen
    monkeypatch.setattr(tile_warmup, "PRECOMPILE_SECONDS", 1)
    monkeypatch.setattr(tile_warmup.subprocess, "Popen", lambda argv: real(["sleep", "60"]))
    start = time.monotonic()
    tile_warmup.precompile(["--seq-lens", "40"], 2)
    assert time.monotonic() - start < 30
    assert "with 2 processes; 2 failed or ran out of time" in capsys.readouterr().out


def test_the_workers_share_out_every_launch_once():
    args = tile_variants.parse_args([*TINY_NSA, "--dtype", "fp16", "--kernels", "interval_fwd", "selection",
                                     "--candidates", "interval_fwd=64,32,4,2"])
    every = tile_warmup.tasks(args)
    assert every[0] == (40, "interval_fwd", None)  # the exact reference's kernels
    assert (40, "interval_fwd", (64, 32, 4, 2)) in every and (40, "selection", None) in every
    parts = [every[i::3] for i in range(3)]
    shared = sum(parts, [])
    assert len(shared) == len(every) == len(set(every)) and set(shared) == set(every)


def test_a_run_with_workers_measures_what_one_without_does(tmp_path, capsys):
    """Under the interpreter nothing compiles, but the workers run every launch (and the run goes on after them)."""
    from components.nsa.triton.launch import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    out = tmp_path / "tiles.json"
    argv = [*TINY_NSA, "--dtype", "fp16", "--kernels", "interval_fwd", "--rep-ms", "1", "--out", str(out)]
    assert tile_variants.main([*argv, "--precompile-workers", "2"]) == 0
    said = capsys.readouterr().out
    assert "with 2 processes" in said and "failed" not in said.split("with 2 processes")[1].splitlines()[0]
    rows = json.loads(out.read_text())["results"]
    shapes = tile_variants.shapes_to_try("interval_fwd", tile_variants.parse_args(argv), torch.float16)
    assert len(rows) == 2 * len(shapes)  # both branches of every shape
    assert all(r["deterministic"] and "error" not in r for r in rows)


def test_a_worker_refuses_a_bad_part(capsys):
    with pytest.raises(SystemExit):
        tile_warmup.main([*TINY_NSA, "--part", "3/2"])
    assert "I must be in [0, N)" in capsys.readouterr().err
