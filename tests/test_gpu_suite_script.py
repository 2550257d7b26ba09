"""bench/gpu_suite.sh, the script that runs the GPU checks and benchmarks, checked without a GPU: a copy of
it in a scratch tree runs with a stand-in `python3` first on PATH, which records every command and
answers at once (or fails where told). So its steps, time budget, logs, summary, archive and exit
status are known to work before any GPU time is spent on them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_suite.sh"

# The stand-in interpreter: says yes to the suite's package probe, logs each command line, writes a
# result JSON for a benchmark (as the real ones do), and fails the commands whose line matches
# $STUB_FAIL, sleeps in those matching $STUB_SLOW or prints $STUB_SAY_TEXT for those matching $STUB_SAY.
STUB = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
if [ -n "${STUB_SAY:-}" ] && [[ "$*" == *"$STUB_SAY"* ]]; then echo "$STUB_SAY_TEXT"; exit 0; fi
if [ -n "${STUB_FAIL:-}" ] && [[ "$*" == *"$STUB_FAIL"* ]]; then echo "stub failure" >&2; exit 3; fi
if [ -n "${STUB_SLOW:-}" ] && [[ "$*" == *"$STUB_SLOW"* ]]; then sleep 30; fi
case "$*" in
  *"-m bench.report"*) echo "| stub report |" ;;
  *"-m bench."*) name=$(echo "$*" | sed -E 's/.*-m bench\\.([a-z_]+).*/\\1/'); echo '{}' > "bench/results/$name-stub.json" ;;
esac
exit 0
"""


def _suite(tmp_path: Path, *args: str, fail: str = "", slow: str = "",
           say: tuple[str, str] = ("", "")) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path / "tree"
    (root / "bench" / "results").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "bench" / "gpu_suite.sh")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "python3").write_text(STUB)
    (stubs / "python3").chmod(0o755)
    log = tmp_path / "commands.log"
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", STUB_LOG=str(log), STUB_FAIL=fail, STUB_SLOW=slow,
               STUB_SAY=say[0], STUB_SAY_TEXT=say[1],
               TMPDIR=str(tmp_path / "tmp"))
    proc = subprocess.run(["bash", str(root / "bench" / "gpu_suite.sh"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, root


def _summary(root: Path) -> list[str]:
    return (root / "bench" / "results" / "logs" / "summary.txt").read_text().splitlines()


def test_every_phase_runs_its_steps_and_packs_them(tmp_path):
    pack = tmp_path / "out" / "gpu_suite.tgz"
    pack.parent.mkdir()
    proc, root = _suite(tmp_path, "--budget", "200", "--pack", str(pack))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line.split(":")[0] for line in _summary(root)]
    assert sorted(steps) == sorted(["gpu_tests_kernels", "gpu_tests_op", "gpu_tests_more", "train_200_steps", "fsdp_single_gpu", "muon_single_gpu", "doctor",
                                    "inspect", "attention_125m", "attention_stages", "attention_paper",
                                    "attention_stages_paper", "attention_32_rows", "attention_stages_32_rows", "selected_flex_32_rows",
                                    "selected_flex_64k", "train_throughput", "loss_memory",
                                    "train_reduce_overhead"])
    assert all(": ok in " in line for line in _summary(root))
    commands = (tmp_path / "commands.log").read_text()
    # The GPU runs use the Triton backend on CUDA, compiled with the default backend.
    assert "-m nsa_titan.cli train recipes/debug.toml --training.device=cuda --model.nsa.backend=triton " \
           "--compile.enable=true --training.steps=200" in commands
    assert "--fail-on-break" in commands
    assert "-m bench.train_throughput --seq-lens 2048 32768 --profile" in commands
    # Every GPU test file runs, each in one of the test steps: the GPU-only ones and those that run their kernels on
    # CUDA when there is a GPU (the interpreter's otherwise): they define DEVICE so, or import another file's.
    tests = SCRIPT.parents[1] / "tests"
    on_cuda = re.compile(r'^DEVICE = "cuda" if torch.cuda.is_available\(\)|^from tests\.\w+ import .*\bDEVICE\b', re.M)
    gpu_test_files = sorted(p.name for p in tests.glob("test_*.py") if p.name.endswith("_gpu.py")
                            or on_cuda.search(p.read_text()))
    assert {"test_nsa_triton_masked.py", "test_nsa_query_offsets.py", "test_nsa_opcheck.py"} <= set(gpu_test_files)
    missing = [name for name in gpu_test_files if f"tests/{name}" not in commands]
    assert not missing, missing
    # Side by side, each pytest keeps its own temporary folder (the shared one prunes other sessions' folders).
    temps = [word for line in commands.splitlines() if "-m pytest" in line
             for word in line.split() if word.startswith("--basetemp=")]
    assert len(temps) == 3 and len(set(temps)) == 3, temps
    # pytest-xdist is there (the stub says yes to every import): each test step runs four workers.
    assert all("-n 4 --dist load" in line for line in commands.splitlines() if "-m pytest" in line)
    with tarfile.open(pack) as tar:
        names = tar.getnames()
    assert "bench/results/logs/summary.txt" in names and "bench/results/logs/report.md" in names
    assert "bench/results/attention-stub.json" in names and "bench/results/train_throughput-stub.json" in names
    assert "| stub report |" in proc.stdout
    assert os.listdir(tmp_path / "tmp") == []  # its scratch folder and time stamp are gone


def test_the_tiles_phase_runs_only_when_named(tmp_path):
    proc, root = _suite(tmp_path, "--budget", "200", "tiles")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split(":")[0] for line in _summary(root)] == ["tiles_paper", "tiles_paper_selected",
                                                               "tiles_125m_32_rows"]
    commands = (tmp_path / "commands.log").read_text()
    assert "-m bench.tile_variants --rep-ms 100 --precompile-workers 8 --preset paper --seq-lens 65536" in commands
    assert "-m bench.tile_variants --rep-ms 100 --precompile-workers 8 --batch 32 --seq-lens 2048" in commands
    # Each candidate is a launch shape the kernel takes, and none is the shipped shape or one of its neighbours
    # (tried anyway): tile_variants' own parser reads them as the GPU run will.
    from bench import tile_variants
    from bench.launch_shapes import shape_problem
    from components.nsa.triton import tile_configs

    candidates = 0
    for line in commands.splitlines():
        if "-m bench.tile_variants" in line:
            args = tile_variants.parse_args(line.split("-m bench.tile_variants", 1)[1].split())
            block_d = tile_configs.head_block(args.head_dim)
            candidates += sum(map(len, args.extra.values()))
            assert args.precompile_workers == 8, line
            for kernel, shapes in args.extra.items():
                assert kernel in args.kernels
                shipped = tuple(tile_configs.tiles(kernel, block_d, 2))
                for shape in shapes:
                    assert shape_problem(kernel, block_d, 2, list(shape)) is None, (kernel, shape)
                    assert shape not in tile_variants.neighbours(shipped), (kernel, shape)
    assert candidates == 8
    assert "| stub report |" in proc.stdout


def test_the_tuned_phase_chooses_from_this_runs_tiles_and_times_both_shapes(tmp_path):
    """tiles, then tuned: tile_choice reads the tile_variants files this run wrote, its file goes to --tiles FILE,
    the op is timed with the shipped shapes and with FILE's, and a later phase's GPU tests and benchmarks take FILE."""
    chosen = tmp_path / "kept" / "tiles.json"
    proc, root = _suite(tmp_path, "--budget", "200", "--tiles", str(chosen), "tiles", "tuned", "check", "attention")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line.split(":")[0] for line in _summary(root)]
    assert steps[:8] == ["tiles_paper", "tiles_paper_selected", "tiles_125m_32_rows", "tile_choice",
                         "attention_32_rows_shipped", "attention_32_rows_tuned", "attention_paper_shipped",
                         "attention_paper_tuned"]
    assert chosen.read_text() == "{}\n"  # the stub's tile_choice file, copied
    commands = (tmp_path / "commands.log").read_text().splitlines()
    assert any(line.endswith("-m bench.tile_choice bench/results/tile_variants-stub.json") for line in commands)
    paper = [line for line in commands if "--preset paper --seq-lens 32768 65536" in line]
    assert [line.endswith(f"--tiles {chosen}") for line in paper] == [False, True]
    assert all("-m bench.attention --no-sdpa --modes fwd+bwd" in line for line in paper)
    tests = [line for line in commands if "-m pytest" in line]
    assert len(tests) == 3 and all(f"--nsa-tiles {chosen}" in line for line in tests)
    benchmarks = [line for line in commands if "-m bench.attention" in line]
    assert len(benchmarks) == 10 and all(f"--tiles {chosen}" in line for line in benchmarks[4:])
    trains = [line for line in commands if "nsa_titan.cli" in line]
    assert trains and all("tiles" not in line for line in trains)  # training keeps the shipped shapes


def test_the_tuned_phase_without_tiles_results_says_so(tmp_path):
    proc, root = _suite(tmp_path, "--budget", "200", "tuned", "attention")
    assert _summary(root)[0] == ("tile_choice: SKIPPED (no tile_variants results from this run: name the tiles phase "
                                 "before tuned)")
    commands = (tmp_path / "commands.log").read_text()
    assert "bench.tile_choice" not in commands and "--tiles" not in commands  # attention ran with the shipped shapes
    assert proc.returncode == 1


def test_the_tuned_phase_leaves_no_earlier_choice_behind(tmp_path):
    """A --tiles file from an earlier run must not pass for this run's choice when this run made none."""
    stale = tmp_path / "tiles.json"
    stale.write_text('{"shapes": []}')
    proc, root = _suite(tmp_path, "--budget", "200", "--tiles", str(stale), "tuned", "check")
    assert not stale.exists()
    assert _summary(root)[1] == f"check: SKIPPED (--tiles {stale} does not exist: the tuned phase wrote no choice)"
    assert "-m pytest" not in (tmp_path / "commands.log").read_text()


def test_the_tuned_phase_times_nothing_when_no_shape_changed(tmp_path):
    proc, root = _suite(tmp_path, "--budget", "200", "tiles", "tuned", say=('["shapes"]', "0"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _summary(root)[-1] == "attention_tuned: ok in 0 s (no shape changed: nothing to compare)"
    assert "-m bench.attention" not in (tmp_path / "commands.log").read_text()


def test_the_tuned_phase_says_when_it_cannot_read_its_choice(tmp_path):
    proc, root = _suite(tmp_path, "--budget", "200", "tiles", "tuned", fail='["shapes"]')
    assert _summary(root)[-1] == "attention_tuned: FAILED (cannot read bench/results/tile_choice-stub.json)"
    assert "-m bench.attention" not in (tmp_path / "commands.log").read_text() and proc.returncode == 1


def test_without_xdist_each_test_step_runs_in_one_process(tmp_path):
    proc, root = _suite(tmp_path, "--budget", "200", "check", fail="import xdist")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tests = [line for line in (tmp_path / "commands.log").read_text().splitlines() if "-m pytest" in line]
    assert len(tests) == 3 and not any(" -n " in line for line in tests)


def test_failed_steps_are_counted_in_the_exit_status(tmp_path):
    proc, root = _suite(tmp_path, "--budget", "200", "check", fail="--compile.enable=true")
    failed = [line for line in _summary(root) if "FAILED (exit 3)" in line]
    assert sorted(line.split(":")[0] for line in failed) == ["fsdp_single_gpu", "inspect", "train_200_steps"]
    assert proc.returncode == 3
    assert "stub failure" in (root / "bench" / "results" / "logs" / "inspect.log").read_text()


def test_a_step_is_cut_at_the_budget_and_later_ones_are_skipped(tmp_path):
    # 22 s of budget: the slow step is cut at what is left (less a grace), the steps after it are skipped.
    proc, root = _suite(tmp_path, "--budget", "22", "attention", slow="--preset paper")
    summary = _summary(root)
    assert [line.split(":")[0] for line in summary[:4]] == ["selected_flex_32_rows", "selected_flex_64k",
                                                            "attention_125m", "attention_stages"]
    assert all(": ok in " in line for line in summary[:4])
    assert summary[4].startswith("attention_paper: FAILED (cut at")
    assert summary[5:] == [f"{name}: SKIPPED (no time left of --budget 22)"
                           for name in ("attention_stages_paper", "attention_32_rows", "attention_stages_32_rows")]
    assert proc.returncode == 4  # one cut, three skipped


@pytest.mark.parametrize("args, message", [
    (["--budget", "ten"], "--budget takes whole seconds"),
    (["--pack"], "--pack needs a value"),
    (["warmup"], "unknown phase 'warmup'"),
    (["--fast"], "unknown option '--fast'"),
    (["--tiles", "absent.json", "check"], "absent.json: no such file. Fix: give the file bench.tile_choice wrote"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    proc, root = _suite(tmp_path, *args)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "commands.log").exists()


def test_help_prints_the_usage_and_runs_nothing(tmp_path):
    proc, root = _suite(tmp_path, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("The checks and benchmarks that need a CUDA GPU")
    assert "./bench/gpu_suite.sh [--budget SECONDS] [--pack FILE] [--tiles FILE] [PHASE ...]" in proc.stdout
    assert "set -uo" not in proc.stdout and not (tmp_path / "commands.log").exists()


def test_a_machine_without_a_gpu_is_told_so_before_any_step_runs(tmp_path):
    """Each phase ran its steps until they failed (exit 6 for check); now one line, exit 2, no step run."""
    proc, root = _suite(tmp_path, "check", fail="torch.cuda.is_available()")
    assert proc.returncode == 2 and proc.stderr.startswith("error: no CUDA GPU here"), proc.stderr
    commands = (tmp_path / "commands.log").read_text().splitlines()
    assert all("-m " not in line for line in commands), commands  # the probes only: no test, tool or benchmark
    assert not (root / "bench" / "results" / "logs" / "summary.txt").exists()
