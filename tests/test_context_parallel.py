"""Context parallelism on CPU with gloo: one sequence over several ranks computes what one process
computes on the whole rows (logits, gradients, losses), compiles whole, and its checkpoints resume at
another context-parallel size on the same data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from components.sequence_shard import SequenceShard
from components.nsa.triton.launch import interpreting
from tests.launch import DEBUG, REPO_ROOT, TINY, assert_resumed_at, env, metrics, train, train_each

pytestmark = pytest.mark.slow

STEPS = 5
# Same global batch (4 rows of 64 tokens) in every layout: one data rank accumulates 2 micro-batches of 2.
COMMON = [*TINY, f"--training.steps={STEPS}", "--training.local_batch_size=2", "--training.global_batch_size=4"]
DENSE = [os.path.join(REPO_ROOT, "recipes", "debug_dense.toml"), *(a for a in COMMON if "nsa." not in a)]
# Attention telemetry at steps 2 and 4, of the stream's first two rows (the same rows at every layout).
NSA = [DEBUG, *COMMON, "--metrics.telemetry_freq=2"]
# Validation too, where one data rank reads the held-out rows one process reads: each context-parallel rank
# scores its share of their tokens, and the loss is the mean over all of them.
VALIDATE = ["--validation.enable=true", "--validation.freq=2", "--validation.steps=2"]
# The Triton kernels under the interpreter (about 4 s a step for one block over 2 x 32 tokens): one
# block, short rows, blocks small enough that both chunks of both ranks have compressed blocks.
TRITON = [DEBUG, *TINY, "--training.steps=3", "--model.nsa.backend=triton", "--model.n_layers=1",
          "--training.seq_len=32", "--training.local_batch_size=1", "--training.global_batch_size=2",
          "--model.nsa.block_size=8", "--model.nsa.block_stride=4"]
CP2 = ["--parallelism.context_parallel_degree=2"]
# TINY pins the CPU: the Triton case runs where the interpreter does (tests/conftest.py sets it without a GPU).
cpu_triton = pytest.mark.skipif(not interpreting(), reason="the CPU form of the Triton case runs under the "
                                                           "Triton interpreter, which this machine does not use")
# fp32; only the order of floating-point reductions differs between layouts (observed: ~1e-7). A document
# mask lost on a rank's chunk moves the losses and gradient norms by ~1e-4 (test_compile_training.py), far above.
RTOL = 1e-5


def test_head_tail_split_round_trips():
    x = torch.arange(2 * 16).view(2, 16)
    shards = [SequenceShard(None, r, 4, 16) for r in range(4)]
    assert [s.chunks() for s in shards] == [((0, 2), (14, 16)), ((2, 4), (12, 14)), ((4, 6), (10, 12)),
                                            ((6, 8), (8, 10))]
    pieces = torch.cat([s.split(x) for s in shards], dim=1)
    assert sorted(pieces[0].tolist()) == list(range(16))
    assert torch.equal(torch.cat([s.positions() for s in shards]), pieces[0])
    with pytest.raises(ValueError, match="2 x 3 equal chunks"):
        SequenceShard(None, 0, 3, 16)


SPLIT_ROWS = [("nsa", 1), ("nsa", 0), ("dense", 1), ("dense", 0)]


@pytest.fixture(scope="module")
def worker_checks():
    """nproc -> the output of one launch of tests/context_parallel_worker.py running every check at that size
    (made once, on first use): starting the ranks costs more than all the checks together."""
    launched = {}

    def run(nproc: int) -> subprocess.CompletedProcess:
        if nproc not in launched:
            checks = [f"{attention}:{masking}" for attention, masking in SPLIT_ROWS] + ["saved:nsa"]
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
                       "--standalone",
                       os.path.join(REPO_ROOT, "tests", "context_parallel_worker.py"), *checks]
            launched[nproc] = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO_ROOT,
                                             timeout=300)
        proc = launched[nproc]
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc

    return run


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("attention,masking", SPLIT_ROWS)
def test_sharded_forward_and_gradients_equal_the_whole_rows(worker_checks, attention, masking, nproc):
    out = worker_checks(nproc).stdout
    assert [out.count(f"{attention} {masking} rank {rank}: ok") for rank in range(nproc)] == [1] * nproc, out


@pytest.mark.parametrize("nproc", [2, 4])
def test_memory_estimate_is_near_what_a_block_saves(worker_checks, nproc):
    """doctor's estimate of one NSA block's saved tensors per local token (activation_memory's per_block
    plus cp x per_row_token) against saved-tensor hooks on a block run under context parallelism."""
    from components.models.args import TransformerArgs
    from components.model_hooks import MemoryLayout
    from components.models.hooks import activation_memory

    measured = float(worker_checks(nproc).stdout.split("nsa saved_bytes_per_local_token")[1].split()[0])
    args = TransformerArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=1024)  # the worker's model
    estimate = activation_memory(args, MemoryLayout(context_parallel=nproc))
    estimated = (estimate.per_block + nproc * estimate.per_row_token) * 4  # fp32
    assert abs(estimated - measured) / measured < 0.1, (estimated, measured)


def _run(args, nproc, folder, start_line_says=None):
    proc = train([*args, f"--job.dump_folder={folder}"], nproc=nproc, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if start_line_says is not None:
        assert f" | {nproc} process(es) on cpu {start_line_says} |" in proc.stdout + proc.stderr
    return metrics(folder)


def _steps(records):
    return {r["step"]: r for r in records if "loss" in r}


def _assert_same_training(got, expected):
    """Losses and gradient norms at every step, and the validation losses where `got` validated."""
    validated = {r["step"]: r["val_loss"] for r in got if "val_loss" in r}
    if validated:
        assert validated == pytest.approx({r["step"]: r["val_loss"] for r in expected if "val_loss" in r}, rel=RTOL)
    got, expected = _steps(got), _steps(expected)
    assert sorted(got) == sorted(expected)
    for step in expected:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=RTOL), (step, key, got, expected)


def _assert_same_telemetry(got, expected):
    """The split run's telemetry (each rank on its share, combined) is the whole rows' telemetry."""
    def telemetry(records):
        return {r["step"]: {k: v for k, v in r.items() if k.startswith("telemetry/")} for r in records
                if any(k.startswith("telemetry/") for k in r)}

    got, expected = telemetry(got), telemetry(expected)
    assert sorted(got) == sorted(expected) == [2, 4]
    for step in expected:
        assert sorted(got[step]) == sorted(expected[step])
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=RTOL, abs=1e-6), (step, key)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process's runs of the NSA debug recipe (masking on, then off) and of the dense one, and of the
    Triton backend where its CPU form runs (under the interpreter; on a GPU machine a CPU run of it is
    refused at start)."""
    runs = [("triton", TRITON)] if interpreting() else []  # the longest first: the others share the other core
    runs += [("nsa", [*NSA, *VALIDATE]), ("nsa_unmasked", [*NSA, "--model.document_masking=false"]), ("dense", DENSE)]
    folders = {name: tmp_path_factory.mktemp(name) for name, _ in runs}
    for proc in train_each([[*args, f"--job.dump_folder={folders[name]}"] for name, args in runs], timeout=600):
        assert proc.returncode == 0, proc.stderr[-4000:]
    found = {name: metrics(folder) for name, folder in folders.items()}
    # The comparisons below can see a lost document mask: with and without it the runs differ beyond RTOL
    # (the source files are long, so only the rows holding a document boundary differ: steps 4 and 5 here).
    masked, unmasked = _steps(found["nsa"]), _steps(found["nsa_unmasked"])
    assert any(masked[step]["grad_norm"] != pytest.approx(unmasked[step]["grad_norm"], rel=10 * RTOL)
               for step in masked)
    return found


# The start line's layout: FSDP shards the parameters over every rank of a sequence's context-parallel group too.
START_LINE_LAYOUTS = {"cp2": "(2-way context parallel), FSDP sharded over 2 ranks = 1 x 2 context-parallel",
                      "dp2_cp2": "(2-way context parallel), FSDP sharded over 4 ranks = 2 x 2 context-parallel"}


@pytest.mark.parametrize("name,nproc,args,baseline", [
    ("cp2", 2, [*NSA, *VALIDATE, *CP2, "--metrics.enable_tensorboard=true"], "nsa"),
    ("cp2_unmasked", 2, [*NSA, *CP2, "--model.document_masking=false"], "nsa_unmasked"),
    ("dp2_cp2", 4, [*NSA, *CP2], "nsa"),
    ("cp2_compiled", 2, [*NSA, *CP2, "--compile.enable=true"], "nsa"),
    ("dense_cp2_compiled", 2, [*DENSE, *CP2, "--compile.enable=true"], "dense"),
    pytest.param("triton_cp2_compiled", 2, [*TRITON, *CP2, "--compile.enable=true"], "triton", marks=cpu_triton),
])
def test_training_equals_one_process(tmp_path, one_process, name, nproc, args, baseline):
    got = _run(args, nproc, tmp_path, START_LINE_LAYOUTS.get(name))
    if name == "cp2":
        assert [r["step"] for r in got if "val_loss" in r] == [2, 4, 5]  # every 2 steps and the last: split rows
    _assert_same_training(got, one_process[baseline])
    if baseline.startswith("nsa"):  # the same probe rows at every layout
        _assert_same_telemetry(got, one_process[baseline])
    if "--metrics.enable_tensorboard=true" in args:  # and the pictures drawn at telemetry steps
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert sorted(events.Tags()["images"]) == ["attention/gates", "attention/selection_layer0",
                                                   "attention/selection_layer1"]
        assert all([e.step for e in events.Images(tag)] == [2, 4] for tag in events.Tags()["images"])
    if "--compile.enable=true" in args:  # inductor, fullgraph: one graph for every step's new boundaries
        assert {(r["compiled_graphs"], r["graph_breaks"]) for r in _steps(got).values()} == {(1, 0)}


def test_a_telemetry_hook_that_cannot_split_sequences_is_refused_at_start(tmp_path):
    plugin = os.path.join(REPO_ROOT, "tests", "plugins", "breaking_model.py")
    proc = train([*NSA, *CP2, f"--job.plugins={plugin}", "--model.name=whole_rows_telemetry_transformer",
                  f"--job.dump_folder={tmp_path}"], nproc=2, timeout=300)
    assert proc.returncode != 0
    assert "telemetry hook has no context= parameter). Fix: set --metrics.telemetry_freq=0" in proc.stderr
    assert "step 1/" not in proc.stdout


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["cp2-to-cp1", "cp1-to-cp2"])
def test_checkpoint_resumes_at_another_context_parallel_size(tmp_path, first, then):
    """Eight steps at one cp size saving at step 4, then steps 5-8 again from that checkpoint at the
    other: the same curve, so the data neither repeats nor skips and the model and optimizer state
    reshard."""
    cp = lambda n: [f"--parallelism.context_parallel_degree={n}"]  # noqa: E731
    save = [*NSA, "--training.steps=8", "--checkpoint.enable=true", "--checkpoint.interval=4",
            "--checkpoint.keep_latest_k=0"]
    straight = [r for r in _run([*save, *cp(first)], first, tmp_path) if r.get("step", 0) > 4]
    proc = train([*save, *cp(then), "--checkpoint.load_step=4", f"--job.dump_folder={tmp_path}"], nproc=then,
                 timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_resumed_at(proc.stdout, tmp_path, 4)  # and metrics.jsonl holds steps 5-8 once: this run's
    resumed = [r for r in metrics(tmp_path) if r.get("step", 0) > 4 and "loss" in r]
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    _assert_same_training(resumed, straight)


def test_layout_errors_name_the_fix(tmp_path):
    proc = train([*NSA, *CP2, "--training.seq_len=62", f"--job.dump_folder={tmp_path}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "2 problems" in proc.stderr
    assert "world size 1 is not divisible by parallelism.context_parallel_degree 2" in proc.stderr
    assert "flag '--parallelism.context_parallel_degree=2'" in proc.stderr  # the setting at fault, named
    assert "launch a multiple of 2 processes (NGPU x NNODES)" in proc.stderr
    assert "--training.seq_len=62" in proc.stderr and "use a multiple of 4" in proc.stderr
