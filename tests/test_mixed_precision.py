"""bf16 training, the default on every GPU, run on the CPU (training.dtype = bfloat16): one process under
autocast, eager and compiled with compile's default backend, and 2-process FSDP2 with its mixed-precision
policy. Each computes in bf16 (its numbers are not fp32's) yet trains as the fp32 run does, and keeps fp32
weights and optimizer state: what its checkpoints hold."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.launch import DEBUG, TINY, losses_and_norms, train

pytestmark = pytest.mark.slow

STEPS = 6
# The same 8 rows a step in every run: 2 processes take 4 each.
COMMON = [DEBUG, *TINY, f"--training.steps={STEPS}", "--training.local_batch_size=4",
          "--training.global_batch_size=8", "--checkpoint.enable=true", f"--checkpoint.interval={STEPS}"]
BF16 = ["--training.dtype=bfloat16"]
RUNS = {"autocast": (1, BF16), "autocast_compiled": (1, [*BF16, "--compile.enable=true"]),
        "fsdp_mixed_precision": (2, [*BF16, "--parallelism.data_parallel_shard_degree=2"])}
# Measured against fp32 over these steps: losses within 2.5e-5 and gradient norms within 1.1e-3 (FSDP2; 4e-4 in
# one process); the bounds leave a factor of about 10 for other machines' kernels.
LOSS_RTOL, NORM_RTOL = 2e-4, 1e-2


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp32")
    proc = train([*COMMON, "--training.dtype=float32", f"--job.dump_folder={folder}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses_and_norms(folder)


def _saved_dtypes(folder) -> dict[str, set[str]]:
    """The dtypes of the tensors a checkpoint holds, by top-level key (model, optimizer)."""
    found: dict[str, set[str]] = {}
    metadata = FileSystemReader(str(folder / "checkpoint" / f"step-{STEPS}" / "model")).read_metadata()
    for key, entry in metadata.state_dict_metadata.items():
        properties = getattr(entry, "properties", None)
        if properties is not None:
            found.setdefault(key.split(".")[0], set()).add(str(properties.dtype))
    return found


@pytest.mark.parametrize("name", sorted(RUNS))
def test_bf16_trains_like_fp32_and_keeps_fp32_state(tmp_path, fp32, name):
    nproc, flags = RUNS[name]
    proc = train([*COMMON, *flags, f"--job.dump_folder={tmp_path}"], nproc=nproc, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = losses_and_norms(tmp_path)
    assert sorted(got) == sorted(fp32) == list(range(1, STEPS + 1))
    # Computed in bf16: some gradient norm moves far beyond the ~2e-7 that compiling or sharding alone moves it.
    assert max(abs(got[step][1] / norm - 1) for step, (_, norm) in fp32.items()) > 1e-4, (name, got, fp32)
    for step, (loss, norm) in fp32.items():
        assert got[step][0] == pytest.approx(loss, rel=LOSS_RTOL), (name, step, got, fp32)
        assert got[step][1] == pytest.approx(norm, rel=NORM_RTOL), (name, step, got, fp32)
    assert got[STEPS][0] < got[1][0] - 0.2  # and it learns
    assert _saved_dtypes(tmp_path) == {"model": {"torch.float32"}, "optimizer": {"torch.float32"}}
