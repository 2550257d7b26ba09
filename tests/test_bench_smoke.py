"""The benchmarks run (on the CPU, as smoke tests: no timing is asserted, only that results are written)."""

from __future__ import annotations

import json
import os

import pytest

from bench import train_throughput


def test_train_throughput_writes_a_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("bench.train_throughput.results_path",
                        lambda name: os.path.join(tmp_path, f"{name}.json"))
    code = train_throughput.main(["--recipes", "recipes/debug.toml", "--seq-lens", "64", "--steps", "3",
                                  "--warmup", "1", "--tokens-per-step", "128", "--allow-cpu",
                                  "--override=--model.nsa.window_size=16"])
    assert code == 0
    result = json.loads((tmp_path / "train_throughput.json").read_text())
    (case,) = result["results"]
    assert case["tokens_per_second"] > 0 and case["local_batch_size"] == 2
    assert result["environment"]["torch"] and result["environment"]["commit"]


def test_attention_bench_refuses_without_cuda(capsys):
    import torch

    from bench import attention

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark would run for real")
    assert attention.main(["--seq-lens", "2048"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
