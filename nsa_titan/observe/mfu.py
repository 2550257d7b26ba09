"""Model FLOP utilisation: achieved training FLOP/s as a share of the device's dense bf16 peak.

The peaks are the vendors' dense (no 2:4 sparsity) bf16 tensor-core figures per device. A GPU not
in the table gets no MFU unless the recipe names its peak (metrics.peak_tflops).
"""

from __future__ import annotations

import re

import torch

# (pattern on the upper-cased torch.cuda.get_device_name, dense bf16 TFLOP/s). First match wins,
# so the more specific variants come before the family name.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGH200\b", 989.0),
    (r"\bH200 NVL\b", 835.0),
    (r"\bH200\b", 989.0),
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bH100\b.*\bPCIE\b", 756.0),
    (r"\bH100\b", 989.0),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    (r"\bH800\b.*\bPCIE\b", 756.0),
    (r"\bH800\b", 989.0),
    (r"\bGB200\b", 2500.0),
    (r"\bB200\b", 2250.0),
    (r"\bB100\b", 1750.0),
    (r"\bA100\b", 312.0),
    (r"\bA800\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
    (r"\bMI300X\b", 1307.0),
    (r"\bMI250X\b", 383.0),
)


def lookup_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 TFLOP/s of a GPU by its reported name, or None when the table does not know it."""
    name = device_name.upper()
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return tflops
    return None


def peak_flops_per_second(device: torch.device, override_tflops: float) -> float | None:
    """The device's peak FLOP/s for MFU: the override when > 0, else the table's entry for the GPU.

    None on CPU and on GPUs missing from the table (the run then logs no MFU).
    """
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    tflops = lookup_peak_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


def mfu_percent(tokens_per_second_per_device: float, flops_per_token: float, peak: float) -> float:
    """100 * achieved FLOP/s / peak FLOP/s, per device."""
    if peak <= 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak}")
    return 100.0 * tokens_per_second_per_device * flops_per_token / peak
