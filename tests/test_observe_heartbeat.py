"""Heartbeat files: content, atomic replacement, rate limit."""

from __future__ import annotations

import json
import os
import socket
import time

import torch

from nsa_titan.observe.heartbeat import Heartbeat, process_rss_bytes


def _vm_rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def _read(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def test_beat_writes_the_rank_file(tmp_path):
    hb = Heartbeat(str(tmp_path), rank=3, device=torch.device("cpu"))
    before = time.time()
    assert hb.beat(7)
    path = tmp_path / "heartbeat" / "rank-3.json"
    record = _read(path)
    assert record["rank"] == 3 and record["step"] == 7
    assert before <= record["time"] <= time.time()
    assert record["host"] == socket.gethostname()
    assert record["pid"] == os.getpid()
    assert record["memory_kind"] == "process_rss"
    # against the kernel's own figure, read independently; allow for allocations in between
    assert abs(record["memory_bytes"] - _vm_rss_bytes()) < 64 * 2**20
    assert hb.beat(8)
    assert _read(path)["step"] == 8
    assert sorted(os.listdir(tmp_path / "heartbeat")) == ["rank-3.json"]  # no temporary files left


def test_rate_limit_and_force(tmp_path):
    hb = Heartbeat(str(tmp_path), rank=0, min_interval_s=3600)
    assert hb.beat(1)
    assert not hb.beat(2)
    assert _read(hb.path)["step"] == 1
    assert hb.beat(3, force=True)
    assert _read(hb.path)["step"] == 3


def test_rank_files_of_an_earlier_larger_launch_are_removed(tmp_path):
    """A run resumed on fewer processes: rank 3's file from the earlier launch would read as a stuck rank."""
    for rank in range(4):
        Heartbeat(str(tmp_path), rank=rank, world_size=4).beat(5)
    (tmp_path / "heartbeat" / "notes.txt").write_text("kept")
    Heartbeat(str(tmp_path), rank=1, world_size=2)  # only rank 0 tidies
    assert len(os.listdir(tmp_path / "heartbeat")) == 5
    Heartbeat(str(tmp_path), rank=0, world_size=2)
    assert sorted(os.listdir(tmp_path / "heartbeat")) == ["notes.txt", "rank-0.json", "rank-1.json"]


def test_a_beat_cut_short_by_a_kill_leaves_no_file_behind(tmp_path):
    """A kill while a beat was written left its temporary file, named after that process: one more with every
    preemption that landed there, which no later run removed."""
    folder = tmp_path / "heartbeat"
    folder.mkdir()
    for name in ("rank-0.json.4242.tmp", "rank-1.json.4343.tmp", "rank-0.json.tmp.notes"):
        (folder / name).write_text("{")
    Heartbeat(str(tmp_path), rank=0, world_size=2).beat(1)
    assert sorted(os.listdir(folder)) == ["rank-0.json", "rank-0.json.tmp.notes"]


def test_rss_is_plausible():
    rss = process_rss_bytes()
    assert 10 * 2**20 < rss < 64 * 2**30  # a Python process with torch loaded
