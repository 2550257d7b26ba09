"""Nodes launched on their own (NNODES > 1) agree at start-up on what they must share: one recipe, one folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.launch import DEBUG, REPO_ROOT, TINY, env, finish, rendezvous_endpoint, rendezvous_id


def _node(endpoint: str, run_id: str, args: list[str]) -> subprocess.Popen:
    """One node of two, one rank each, meeting at a c10d rendezvous on loopback (as run_train.sh starts them)."""
    command = [sys.executable, "-m", "nsa_titan.launch", "--nproc_per_node=1", "--nnodes=2", "--rdzv_backend=c10d",
               f"--rdzv_endpoint={endpoint}", f"--rdzv_id={run_id}", "-m", "nsa_titan.cli", "train", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            cwd=REPO_ROOT, start_new_session=True)


def test_the_rendezvous_port_is_held_from_its_choice_to_the_end_of_the_launch():
    """No other launch can take the port between its choice and the nodes' start: this process holds it."""
    with rendezvous_endpoint() as endpoint:
        host, port = endpoint.rsplit(":", 1)
        with socket.socket() as sock, pytest.raises(OSError):
            sock.bind((host, int(port)))
    with socket.socket() as sock:  # given back after the launch
        sock.bind((host, int(port)))


def test_nodes_launched_with_different_recipes_are_refused_on_every_node(tmp_path):
    """One node given another learning rate trained its shards apart in silence; another step count hung."""
    run_id = rendezvous_id()
    args = [DEBUG, *TINY, "--training.steps=2", f"--job.dump_folder={tmp_path / 'run'}"]
    with rendezvous_endpoint() as endpoint:
        nodes = [_node(endpoint, run_id, args), _node(endpoint, run_id, [*args, "--optimizer.lr=0.01"])]
        results = [finish(node, 300) for node in nodes]
    host = socket.gethostname()
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 2, err[-3000:]
        said = [line for line in err.splitlines() if "the ranks run different recipes" in line]
        assert said and f"differs from rank 0 (on {host}) in optimizer.lr: " in said[0], err[-3000:]
        assert "Fix: launch every node with the same recipe, overrides and code." in said[0]
        assert "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "run" / "checkpoint").exists() or not os.listdir(tmp_path / "run" / "checkpoint")


def test_a_dump_folder_a_rank_cannot_see_is_refused_on_every_rank(tmp_path):
    """Each rank passes the folder it would see: a folder local to each node is two folders."""
    shared, other = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    other.mkdir()
    worker = os.path.join(REPO_ROOT, "tests", "start_agreement_worker.py")
    for folders, expected in (([shared, shared], ["shared", "shared"]),
                              ([shared, other], ["job.dump_folder", "job.dump_folder"])):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
                   "--standalone", worker, *map(str, folders)]
        proc = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
        assert [line.split(": ", 1)[1].split(" ")[0] for line in said] == expected, proc.stdout
        if expected[0] != "shared":
            assert all("is not shared by every rank: rank 1 (on " in line and "does not see the file rank 0 (on"
                       in line for line in said), said
        assert os.listdir(shared) == []  # the probe is removed


def test_a_node_that_never_joins_ends_the_launch_with_one_line(tmp_path):
    """torchrun's own end was a rendezvous traceback of 41 lines (after 600 s; 5 s here)."""
    with rendezvous_endpoint() as endpoint:
        command = [sys.executable, "-m", "nsa_titan.launch", "--nproc_per_node=1", "--nnodes=2",
                   "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id={rendezvous_id()}",
                   "--rdzv_conf=join_timeout=5", "-m", "nsa_titan.cli", "train", DEBUG, *TINY,
                   f"--job.dump_folder={tmp_path / 'run'}"]
        proc = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith("error: the nodes did not meet at 127.0.0.1:"), proc.stderr[-3000:]
    assert "Fix: start every node (NNODES of them) with the same RDZV_ENDPOINT" in said[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
