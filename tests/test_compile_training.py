"""The compiled path users get: the debug recipe with compile.enable = true and compile's default backend
(inductor), trained on the CPU in one process and as 2-process FSDP2 over gloo, for each attention
backend. Compiled runs must compute what eager runs compute, with no graph break and no recompile
after the first step.
"""

from __future__ import annotations

import pytest

from components.nsa.triton.launch import interpreting
from tests.launch import DEBUG, TINY, losses, metrics, train

pytestmark = pytest.mark.slow

STEPS = 4
# Adam's first updates are sign-like (g / sqrt(g^2) when eps is tiny), so a gradient component of
# 1e-9 that a fused kernel computes as -1e-9 moves a weight by 2 x lr; a larger eps makes the
# comparison measure the model's numerics rather than that amplification.
# Short synthetic documents: every step's rows hold other document boundaries (the shipped recipes mask
# documents), so a guard on them would show as a recompile.
COMMON = [DEBUG, *TINY, f"--training.steps={STEPS}", "--optimizer.eps=1e-4", "--data.source=synthetic",
          "--data.synthetic.min_length=5", "--data.synthetic.max_length=40"]
# fp32 on the CPU: inductor fuses and reorders reductions, nothing else differs (measured: at most 2e-7
# in loss and gradient norm, every backend, one process and FSDP2; a dropped document mask moves them 1e-4).
RTOL = 1e-5
BACKENDS = {
    "reference": ["--training.local_batch_size=2", "--training.global_batch_size=4"],
    # Triton's interpreter runs each kernel program in Python (about 4 s for the forward and backward of
    # one block over 2 x 32 tokens): one block, short rows, two samples a step.
    # Blocks of 8 and documents of 12 tokens or more keep every row's compressed-block count at 2 or more
    # (a count of 0 or 1 is a size Dynamo specializes on, so crossing it would recompile).
    "triton": ["--model.nsa.backend=triton", "--model.n_layers=1", "--training.seq_len=32",
               "--training.local_batch_size=1", "--training.global_batch_size=2", "--model.nsa.block_size=8",
               "--model.nsa.block_stride=4", "--data.synthetic.min_length=12"],
    # The flag layer may not set [model.nsa] beside a dense model: drop TINY's window.
    "dense": ["--model.attention=dense", "--training.local_batch_size=2", "--training.global_batch_size=4"],
}
COMPILED = ["--compile.enable=true"]  # and nothing else: the backend is the default
FSDP = ["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=1"]


def _run(folder, flags, nproc=1) -> dict[int, dict]:
    common = COMMON
    if "--model.attention=dense" in flags:
        common = [a for a in COMMON if not a.startswith("--model.nsa.")]
    proc = train([*common, *flags, f"--job.dump_folder={folder}"], nproc=nproc, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["step"]: r for r in metrics(folder) if "loss" in r}


def _assert_same_losses(got: dict, expected: dict, what: str) -> None:
    """Losses and gradient norms at every step (a dropped document mask moves the loss by about 1e-4)."""
    assert sorted(got) == list(range(1, STEPS + 1)), what
    for step in expected:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=RTOL), (what, step, key)


def _assert_one_compile(records: dict, what: str) -> None:
    """Every logged step reports the same number of graphs as the first: nothing recompiled."""
    counts = {step: (r["compiled_graphs"], r["graph_breaks"]) for step, r in records.items()}
    first = counts[1]
    assert first[0] >= 1 and first[1] == 0, (what, counts)
    assert all(c == first for c in counts.values()), (what, counts)


@pytest.fixture(scope="module")
def eager_runs(tmp_path_factory):
    """backend -> its eager run (made once, on first use)."""
    runs = {}

    def run(backend: str) -> dict[int, dict]:
        if backend not in runs:
            runs[backend] = _run(tmp_path_factory.mktemp(f"eager_{backend}"), BACKENDS[backend])
            assert "compiled_graphs" not in runs[backend][1]
        return runs[backend]

    return run


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_compiled_training_matches_eager_in_one_and_two_processes(tmp_path, eager_runs, backend):
    if backend == "triton" and not interpreting():
        pytest.skip("the CPU form of this test runs the Triton kernels under the interpreter")
    flags = BACKENDS[backend]
    eager = eager_runs(backend)

    compiled = _run(tmp_path / "compiled", [*flags, *COMPILED])
    _assert_same_losses(compiled, eager, f"{backend}, one process")
    _assert_one_compile(compiled, f"{backend}, one process")

    sharded = _run(tmp_path / "fsdp", [*flags, *COMPILED, *FSDP], nproc=2)
    _assert_same_losses(sharded, eager, f"{backend}, FSDP2 x 2")
    _assert_one_compile(sharded, f"{backend}, FSDP2 x 2")
    assert losses(tmp_path / "fsdp")[STEPS] < losses(tmp_path / "fsdp")[1]


@pytest.mark.parametrize("mode, blocks", [("full", 2), ("selective", 1)])
def test_activation_checkpointing_compiles_whole_and_trains_like_none(tmp_path, eager_runs, mode, blocks):
    """The shipped long-context recipes' combination (NSA, document masking, compile's default backend,
    activation checkpointing): one graph per block, no break or recompile, and the eager run's numbers
    without checkpointing. selective_every = 2 recomputes block 0 of the 2."""
    flags = [*BACKENDS["reference"], *COMPILED, f"--activation_checkpoint.mode={mode}"]
    flags += ["--activation_checkpoint.selective_every=2"] if mode == "selective" else []
    proc = train([*COMMON, *flags, f"--job.dump_folder={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f" | activations recomputed in {blocks} of 2 blocks\n" in proc.stdout
    got = {r["step"]: r for r in metrics(tmp_path) if "loss" in r}
    _assert_same_losses(got, eager_runs("reference"), f"activation checkpointing {mode}")
    _assert_one_compile(got, f"activation checkpointing {mode}")
