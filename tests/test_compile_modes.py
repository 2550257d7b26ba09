"""compile.mode: inductor's modes reach torch.compile (and inspect's recorder); CUDA-graph modes are
refused where they cannot run. The recipe rules are in test_config_errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nsa_titan.inspect.recorder import BlockTracker, RecordingBackend
from nsa_titan.parallel.compile import compile_blocks
from tests.launch import assert_cuda_only_refused_at_start


@pytest.mark.parametrize("mode,expected", [("default", {}), ("reduce-overhead", {"mode": "reduce-overhead"}),
                                           ("max-autotune-no-cudagraphs", {"mode": "max-autotune-no-cudagraphs"})])
def test_compile_blocks_passes_the_mode_to_torch_compile(monkeypatch, mode, expected):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    compile_blocks([nn.Linear(2, 2), nn.Linear(2, 2)], fullgraph=True, backend="inductor", mode=mode)
    assert calls == [{"fullgraph": True, "backend": "inductor", **expected}] * 2


def test_inspect_compiles_with_the_modes_inductor_options():
    from torch._inductor import list_mode_options

    recorder = RecordingBackend("inductor", BlockTracker(), "max-autotune-no-cudagraphs")
    assert recorder.inner.keywords["config_patches"] == list_mode_options("max-autotune-no-cudagraphs")
    assert RecordingBackend("inductor", BlockTracker()).inner is not recorder.inner


def test_cuda_graphs_off_cuda_are_an_error(tmp_path, capsys):
    """training.device = auto on a machine without CUDA: known only once the run starts."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, where CUDA graphs run")
    assert_cuda_only_refused_at_start(tmp_path, capsys, ["--compile.enable=true", "--compile.mode=reduce-overhead"],
                                      "replays CUDA graphs, but this run is on cpu. Fix: set --compile.mode=default")
