"""Data parallelism on CPU with gloo: every layout trains like one process, and failures end cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.launch import (DEBUG, REPO_ROOT, TINY, env, finish, losses_and_norms, metrics, rendezvous_endpoint,
                          rendezvous_id, start_training, stop_all, train)

pytestmark = pytest.mark.slow

STEPS = 5
# Same global batch (4 samples) in every layout: one process accumulates 2 micro-batches of 2. Validated at
# the last step: the held-out set is the same rows in every layout (each rank reads its shards' share).
COMMON = [DEBUG, *TINY, f"--training.steps={STEPS}", "--training.local_batch_size=2",
          "--training.global_batch_size=4", "--validation.enable=true", f"--validation.freq={STEPS}",
          "--validation.steps=3"]
# fp32 on CPU; only the order of floating-point reductions differs between layouts (measured: 2e-7
# for AdamW; 6e-5 for Muon, whose Newton-Schulz iteration runs in bf16).
RTOL = 1e-5
MUON_RTOL = 2e-4


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    proc = train([*COMMON, f"--job.dump_folder={out}"])
    assert proc.returncode == 0, proc.stderr
    assert "FSDP2" not in proc.stdout + proc.stderr  # one process trains unwrapped unless asked
    return losses_and_norms(out)


LAYOUTS = {
    "fsdp": (2, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=1"]),
    "ddp": (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2"]),
    "hsdp": (4, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2",
                 "--training.local_batch_size=1"]),
    # FSDP2 on a mesh of one rank (what a one-GPU machine can run of the sharded path)
    "fsdp_one_process": (1, ["--parallelism.fsdp_single_process=true"]),
    # Gradient accumulation on a replicated mesh: DDP's all-reduce (HSDP's across replicas) waits for the last
    # micro-batch of a step (set_gradient_sync).
    "ddp_accum": (2, ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=2",
                      "--training.local_batch_size=1"]),
    "hsdp_accum": (4, ["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2",
                       "--training.local_batch_size=1", "--training.global_batch_size=8"]),
}
MESHES = {"fsdp": "FSDP sharded over 2 ranks", "ddp": "DDP over 2 replicas",
          "hsdp": "HSDP: 2 replicas, each sharded over 2 ranks", "fsdp_one_process": "FSDP2 on a mesh of one rank",
          "ddp_accum": "DDP over 2 replicas", "hsdp_accum": "HSDP: 2 replicas, each sharded over 2 ranks"}
MICRO_BATCHES = {"ddp_accum": 2, "hsdp_accum": 2, "fsdp_one_process": 2}


@pytest.fixture(scope="module")
def single_process_losses_of_8(tmp_path_factory):
    """One process's run with a global batch of 8 (4 micro-batches of 2)."""
    out = tmp_path_factory.mktemp("single_8")
    proc = train([*COMMON, "--training.global_batch_size=8", f"--job.dump_folder={out}"])
    assert proc.returncode == 0, proc.stderr
    return losses_and_norms(out)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(tmp_path, request, layout):
    batch_of_8 = "--training.global_batch_size=8" in LAYOUTS[layout][1]
    expected = request.getfixturevalue("single_process_losses_of_8" if batch_of_8 else "single_process_losses")
    assert_trains_like(expected, layout, tmp_path)


def assert_trains_like(expected: dict, layout: str, folder, *extra: str, rtol: float = RTOL) -> None:
    """A run in `layout` (with `extra` flags) logs every step, on the mesh it says, with one process's losses
    and gradient norms (the norm catches gradients summed instead of averaged over ranks, which AdamW's
    losses hardly show)."""
    nproc, flags = LAYOUTS[layout]
    proc = train([*COMMON, *extra, *flags, f"--job.dump_folder={folder}"], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f", {MESHES[layout]} |" in proc.stdout + proc.stderr
    assert f", {MICRO_BATCHES.get(layout, 1)} micro-batch(es)/step" in proc.stdout + proc.stderr
    assert "DTensor random operators" not in proc.stderr  # torch's warning of every CPU rank, kept out
    got = losses_and_norms(folder)
    assert sorted(got) == list(range(1, STEPS + 1)) and len(got[STEPS]) == 3  # with the validation loss
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=rtol), (layout, step, got, expected)


def test_validation_on_a_rank_whose_shards_hold_no_held_out_document(tmp_path):
    """One held-out document, in logical shard 0 of 2: FSDP's rank 1 owns shard 1 and runs only filler rows,
    which count nothing, yet joins every forward's collectives (no hang). The loss is one process's."""
    flags = ["--data.source=synthetic", "--data.synthetic.validation_documents=1", "--data.logical_shards=2"]
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    proc = train([*COMMON, *flags, f"--job.dump_folder={single}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = train([*COMMON, *flags, *LAYOUTS["fsdp"][1], f"--job.dump_folder={sharded}"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, got = losses_and_norms(single), losses_and_norms(sharded)
    assert len(got[STEPS]) == 3 and got[STEPS] == pytest.approx(expected[STEPS], rel=RTOL), (got, expected)


def test_telemetry_reads_the_same_rows_at_every_data_parallel_size(tmp_path):
    """The telemetry probe is the stream's first two rows whatever the layout: two DDP replicas (rank 0 owning
    logical shards 0 and 2) and one process with loader workers report one plain process's telemetry, so a
    resume at another world size continues the curve."""
    flags = ["--training.steps=1", "--metrics.telemetry_freq=1"]
    runs = {"single": ([], 1), "ddp": (LAYOUTS["ddp"][1], 2), "workers": (["--data.num_workers=2"], 1)}
    telemetry = {}
    for name, (extra, nproc) in runs.items():
        proc = train([*COMMON, *flags, *extra, f"--job.dump_folder={tmp_path / name}"], nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (telemetry[name],) = [r for r in metrics(tmp_path / name) if any(k.startswith("telemetry/") for k in r)]
    assert len(telemetry["single"]) > 10
    for name in ("ddp", "workers"):
        assert telemetry[name] == pytest.approx(telemetry["single"], rel=RTOL, abs=1e-6), name


@pytest.fixture(scope="module")
def single_process_muon_losses(tmp_path_factory, single_process_losses):
    out = tmp_path_factory.mktemp("single_muon")
    proc = train([*COMMON, "--optimizer.name=muon", f"--job.dump_folder={out}"])
    assert proc.returncode == 0, proc.stderr
    muon = losses_and_norms(out)
    assert muon[STEPS][0] != pytest.approx(single_process_losses[STEPS][0], rel=1e-3)  # Muon moved them, not AdamW
    return muon


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "fsdp_one_process"])
def test_muon_when_sharded_matches_single_process(tmp_path, single_process_muon_losses, layout):
    """Muon orthogonalizes whole matrices: under FSDP2 (and HSDP's 2-D mesh) the matrices are dealt out over
    the shard group, each put together whole on one rank, so sharded ranks train as one process does (a mesh
    of one rank holds them whole)."""
    assert_trains_like(single_process_muon_losses, layout, tmp_path, "--optimizer.name=muon", rtol=MUON_RTOL)


def test_two_node_launch_on_loopback(tmp_path, single_process_losses):
    run_id = rendezvous_id()
    procs, logs = [], []
    with rendezvous_endpoint() as endpoint:
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                   "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id={run_id}",
                   "-m", "nsa_titan.cli", "train", *COMMON, f"--job.dump_folder={tmp_path / 'run'}"]
            # Each node's output goes to a file: a pipe left unread while the other node's is read could fill and
            # stall its node in a collective.
            logs.append(tmp_path / f"node-{node}.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env(),
                                              start_new_session=True))
        try:
            for proc in procs:
                proc.wait(timeout=600)
        finally:
            for proc in procs:  # a node left running would take the cores of every later test
                stop_all(proc)
    outputs = [log.read_text() for log in logs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    # One rank per node, one mesh (rank 0, which says it, is either node: c10d numbers the agents itself).
    assert ", FSDP sharded over 2 ranks |" in "".join(outputs)
    got = losses_and_norms(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, expected in single_process_losses.items():
        assert got[step] == pytest.approx(expected, rel=RTOL), (step, got, single_process_losses)


_GLOO = "[third_party/gloo/gloo/transport/tcp/pair.cc:534] "  # where gloo says it


@pytest.mark.parametrize("said, gone", [
    ("Connection closed by peer [127.0.0.1]:40213", "Connection closed by peer"),
    ("Read error [127.0.0.1]:40213: Connection reset by peer", "Connection reset by peer"),
    ("writev [127.0.0.1]:40213: Broken pipe", "Broken pipe"),
    ("Socket closed", "Socket closed"),
])
def test_every_gloo_wording_of_a_gone_peer_is_a_lost_peer(said, gone):
    """Which of gloo's words a survivor gets depends on which of its threads meets the dead peer's socket
    first; each one is a lost peer, so the launcher blames the rank that died, not the survivor. Without a
    backend's word the same text (a pipe in the data pipeline, a download) is not."""
    import torch.distributed as dist

    from nsa_titan.parallel.distributed import lost_a_peer

    assert lost_a_peer(dist.DistBackendError(_GLOO + said)) == gone
    assert lost_a_peer(RuntimeError(said)) is None


def _rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return int(dict(v.split(b"=", 1) for v in fh.read().split(b"\0") if b"=" in v)[b"RANK"])


def test_killed_rank_makes_the_other_exit(tmp_path):
    """kill -9 one rank mid-run: the survivor must exit non-zero soon, not hang."""
    proc = start_training([*COMMON, "--training.steps=100000", "--parallelism.data_parallel_shard_degree=2",
                           f"--job.dump_folder={tmp_path}"], tmp_path, nproc=2)
    children = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "nsa_titan.cli"], capture_output=True, text=True)
    pids = {_rank_of(int(p)): int(p) for p in children.stdout.split()}
    assert sorted(pids) == [0, 1], children.stdout
    os.kill(pids[1], signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        stop_all(proc)
        pytest.fail("the surviving rank hung after its peer was killed")
    assert proc.returncode == 1
    said = [line for line in err.splitlines() if line.startswith("error: ")]
    assert said[-1].startswith("error: the run stopped: rank 1 failed first (signal SIGKILL); a signal leaves no "
                               "message"), err[-3000:]


def test_a_rank_without_data_ends_the_run_with_one_message(tmp_path):
    """One text file is one document, which one logical shard holds: rank 1's shards are empty. It must say
    so and end (the other rank waits in a collective), without a traceback, and the launcher stops the rest."""
    corpus = tmp_path / "only.txt"
    corpus.write_text("a single document, too small to share between ranks " * 20)
    proc = train([DEBUG, *TINY, "--training.steps=3", "--data.source=text_files", f"--data.text_files.paths={corpus}",
                  "--data.text_files.validation_fraction=0", "--data.logical_shards=2",
                  "--parallelism.data_parallel_shard_degree=2", f"--job.dump_folder={tmp_path / 'run'}"],
                 nproc=2)
    assert proc.returncode == 2, proc.stderr[-3000:]  # bad input, as one process would exit
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert said[-1] == "error: the run stopped: rank 1 failed first (exit code 2); its own message is above."
    assert "error: rank 1: data split 'train': logical shards [1] of data-parallel rank 1 hold no documents, so " \
           "this rank has nothing to train on. Fix: add data, or lower data.logical_shards or data.num_workers." in said
    # Rank 0 waited in a collective: it may say it lost its peer (or be ended by the launcher first).
    assert all(line.startswith("error: rank 0: lost contact with another rank (") for line in said[:-1]
               if line.startswith("error: rank 0"))
    assert len(said) <= 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "failed (exitcode" not in proc.stderr, proc.stderr[-3000:]  # torchrun's own log line of the same
    assert "closing signal" not in proc.stderr, proc.stderr[-3000:]  # nor its line for each rank it then ends


def test_a_stop_every_rank_agrees_on_is_said_once(tmp_path):
    """The NaN guard's stop is an agreed one: each rank printed the same error, and the launcher blamed 'rank 1
    failed first'."""
    proc = train([DEBUG, *TINY, "--training.steps=5", "--optimizer.lr=1e30", "--training.max_norm=0",
                  "--fault.max_bad_steps=0", f"--job.dump_folder={tmp_path / 'run'}"], nproc=2)
    assert proc.returncode == 3, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 2 and said[0].startswith("error: stopping at step "), said
    assert said[1] == "error: the run stopped: every rank stopped together (exit code 3); the message is above."


def test_halt_file_stops_every_rank_at_the_same_step(tmp_path):
    """The stop request rides on the per-step agreement, so ranks stop together, between log steps too."""
    proc = start_training([*COMMON, "--training.steps=100000", "--metrics.log_freq=100000", "--checkpoint.enable=true",
                           "--checkpoint.interval=100000", "--parallelism.data_parallel_shard_degree=2",
                           f"--job.dump_folder={tmp_path}"], tmp_path, nproc=2)
    open(os.path.join(tmp_path, "HALT"), "w").close()
    out, err = finish(proc, timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped = re.search(r"stopping after step (\d+)", out)
    assert stopped, out
    assert os.path.isfile(os.path.join(tmp_path, "checkpoint", f"step-{stopped.group(1)}", "COMPLETE"))


def test_sigterm_to_the_launcher_saves_even_with_loader_workers(tmp_path):
    """torchrun signals each worker's whole process group; loader workers must not die of it first."""
    proc = start_training([*COMMON, "--training.steps=100000", "--checkpoint.enable=true",
                           "--checkpoint.interval=100000", "--data.num_workers=2", "--validation.freq=100000",
                           "--parallelism.data_parallel_shard_degree=2", f"--job.dump_folder={tmp_path}"],
                          tmp_path, nproc=2)
    # (no validation before the stop: its reads would lengthen it, which torchrun allows 30 s before it kills
    # the ranks)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc, timeout=120)
    stopped = re.search(r"stopping after step (\d+) \(SIGTERM\)", out)
    assert stopped, (out[-2000:], err[-3000:])
    assert os.path.isfile(os.path.join(tmp_path, "checkpoint", f"step-{stopped.group(1)}", "COMPLETE"))


def test_sigusr1_to_run_train_sh_dumps_every_ranks_stacks_and_the_run_goes_on(tmp_path):
    proc = start_training([*COMMON, "--training.steps=100000", "--parallelism.data_parallel_shard_degree=2",
                           f"--job.dump_folder={tmp_path}"], tmp_path,
                          command=[os.path.join(REPO_ROOT, "run_train.sh")], extra_env={"NGPU": "2"})
    stacks = [os.path.join(tmp_path, "stacks", f"rank-{rank}.txt") for rank in (0, 1)]
    try:
        proc.send_signal(signal.SIGUSR1)
        deadline = time.time() + 120
        while not all(os.path.exists(p) and "end of SIGUSR1 stack dump" in _text(p) for p in stacks):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        open(os.path.join(tmp_path, "HALT"), "w").close()  # the launch is still in run_train.sh's hands
        out, err = finish(proc, timeout=180)
    finally:
        stop_all(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "stopping after step" in out and "trainer.py" in _text(stacks[1])


def _text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def test_a_second_stop_signal_to_run_train_sh_ends_every_process_at_once(tmp_path):
    """The second request ends the ranks (and their loader workers) and torchrun at once without a save: one
    line, exit 128 + the signal, no process left behind and no halt file to stop the next run."""
    from tests.plugins.slow_steps import HOLD_ENV

    hold = str(tmp_path / "hold")
    proc = start_training([*COMMON, "--training.steps=100000", "--checkpoint.enable=true",
                           "--checkpoint.interval=100000", "--data.num_workers=1", "--validation.freq=100000",
                           "--parallelism.data_parallel_shard_degree=2", "--job.plugins=tests.plugins.slow_steps",
                           "--optimizer.name=slow_adamw", f"--job.dump_folder={tmp_path}"], tmp_path,
                          command=[os.path.join(REPO_ROOT, "run_train.sh")], extra_env={"NGPU": "2", HOLD_ENV: hold})
    try:
        open(hold, "w").close()  # the ranks wait inside a step: the halt file cannot end the run before the second
        deadline = time.time() + 120
        while not os.path.exists(hold + ".held") and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        said = []
        for line in proc.stderr:
            said.append(line)
            if line.startswith("run_train.sh: stop requested"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        err = "".join(said) + err
        left = subprocess.run(["pgrep", "-f", f"job.dump_folder={tmp_path}"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["pkill", "-KILL", "-f", f"job.dump_folder={tmp_path}"], check=False)  # orphans left
        if os.path.exists(hold):
            os.remove(hold)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.count("error:") == 1 and "error: train interrupted at once: nothing was saved" in err, err[-3000:]
    assert "Killed" not in err, err[-3000:]  # bash's job line for the launcher it ended
    assert left == "", left
    saved = tmp_path / "checkpoint"
    assert not saved.exists() or not any((saved / d / "COMPLETE").is_file() for d in os.listdir(saved))
    assert not os.path.exists(os.path.join(tmp_path, "HALT"))
    assert not os.path.exists(os.path.join(tmp_path, "stacks"))  # the killed ranks' empty dump files went too


def test_ranks_whose_launcher_is_killed_stop_with_a_save(tmp_path):
    """torchrun killed with SIGKILL cannot end its ranks: each gets a SIGTERM from the kernel instead (its parent
    died), so they stop together after a step with a checkpoint rather than train on as orphans."""
    proc = start_training([*COMMON, "--training.steps=100000", "--checkpoint.enable=true",
                           "--checkpoint.interval=100000", "--validation.freq=100000",
                           "--parallelism.data_parallel_shard_degree=2", f"--job.dump_folder={tmp_path}"],
                          tmp_path, nproc=2)
    try:
        proc.kill()  # the launcher alone: torchrun started each rank in a session of its own
        out, err = proc.communicate(timeout=120)  # the pipes close when the last rank exits
    finally:
        subprocess.run(["pkill", "-KILL", "-f", f"job.dump_folder={tmp_path}"], check=False)  # orphans left
    stopped = re.search(r"stopping after step (\d+) \(its launcher ended\); the checkpoint above resumes it", out)
    assert stopped, (out[-2000:], err[-3000:])
    assert os.path.isfile(os.path.join(tmp_path, "checkpoint", f"step-{stopped.group(1)}", "COMPLETE"))


def test_run_train_sh_turns_a_stop_signal_into_a_clean_stop_of_every_rank(tmp_path):
    """SIGTERM to run_train.sh (a scheduler's preemption, Ctrl-C) halts all ranks after a step and a
    save, and the whole launch exits 0: torchrun never sees the signal, so it kills nobody."""
    proc = start_training([*COMMON, "--training.steps=100000", "--checkpoint.enable=true",
                           "--checkpoint.interval=100000", "--parallelism.data_parallel_shard_degree=2",
                           f"--job.dump_folder={tmp_path}"], tmp_path,
                          command=[os.path.join(REPO_ROOT, "run_train.sh")], extra_env={"NGPU": "2"})
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc, timeout=180)
    assert proc.returncode == 0, err[-3000:]
    stopped = re.search(r"stopping after step (\d+) \(halt file", out)
    assert stopped, (out[-2000:], err[-3000:])
    assert "stop requested" in err
    assert os.path.isfile(os.path.join(tmp_path, "checkpoint", f"step-{stopped.group(1)}", "COMPLETE"))
    assert not os.path.exists(os.path.join(tmp_path, "HALT"))  # the next run is not stopped by it
