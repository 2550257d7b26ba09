"""MFU: the peak table by GPU name, the override, and the percentage."""

from __future__ import annotations

import pytest
import torch

from components.models import flops_per_token
from nsa_titan.observe import mfu
from tests.test_models_helpers import VOCAB, tiny_args

# Names as torch.cuda.get_device_name reports them, with the vendors' dense bf16 TFLOP/s.
KNOWN = {
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,
    "NVIDIA H200 NVL": 835.0,
    "NVIDIA GH200 480GB": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA L40": 181.0,
    "NVIDIA L4": 121.0,
    "NVIDIA A10": 125.0,
    "NVIDIA B200": 2250.0,
    "AMD Instinct MI300X": 1307.0,
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_table_matches_each_gpu_family(name):
    assert mfu.lookup_peak_tflops(name) == KNOWN[name]


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA A10G", "Tesla V100-SXM2-16GB", "weird gpu"])
def test_unknown_gpus_have_no_peak(name):
    assert mfu.lookup_peak_tflops(name) is None


def test_cuda_device_is_looked_up_by_name(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: seen.append(device) or "NVIDIA H100 PCIe")
    device = torch.device("cuda", 3)
    assert mfu.peak_flops_per_second(device, 0.0) == 756e12
    assert seen == [device]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert mfu.peak_flops_per_second(device, 0.0) is None


def test_cpu_has_no_peak_unless_overridden():
    assert mfu.peak_flops_per_second(torch.device("cpu"), 0.0) is None
    assert mfu.peak_flops_per_second(torch.device("cpu"), 1.5) == 1.5e12


def test_override_wins_over_the_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert mfu.peak_flops_per_second(torch.device("cuda", 0), 400.0) == 400e12


def test_mfu_percent():
    fpt = flops_per_token(tiny_args(), VOCAB, 64)
    tokens_per_second = 12345.0
    peak = 989e12
    expected = tokens_per_second * fpt / peak * 100
    assert mfu.mfu_percent(tokens_per_second, fpt, peak) == pytest.approx(expected, rel=1e-12)
    # 1e12 FLOP/s achieved on a 2e12 peak is half of it
    assert mfu.mfu_percent(1000.0, 1e9, 2e12) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        mfu.mfu_percent(1.0, 1.0, 0.0)
