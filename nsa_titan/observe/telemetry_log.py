"""NSA telemetry as flat float records for metrics.jsonl and TensorBoard.

collect_nsa_telemetry returns 0-d device tensors keyed "nsa/layer{i}/{branch}/{stat}" and
"nsa/layer{i}/sel_distance/{bucket}"; here they become "telemetry/layer{i}/..." floats, copied to
the host together in one transfer.
"""

from __future__ import annotations

import torch

PREFIX = "telemetry/"
_SOURCE_PREFIX = "nsa/"


def telemetry_records(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """{"nsa/layer0/sel/gate_mean": tensor} -> {"telemetry/layer0/sel/gate_mean": float}, key order kept."""
    if not stats:
        return {}
    keys = list(stats)
    values = torch.stack([stats[k].detach().reshape(()).float() for k in keys]).tolist()
    return {PREFIX + k.removeprefix(_SOURCE_PREFIX): float(v) for k, v in zip(keys, values)}


def layer_means(records: dict[str, float], stat: str) -> dict[str, float]:
    """The mean over layers of one per-branch statistic, e.g. stat="gate_mean" -> {"cmp": .., "sel": .., "win": ..}."""
    sums: dict[str, list[float]] = {}
    for key, value in records.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] + "/" == PREFIX and parts[3] == stat:
            sums.setdefault(parts[2], []).append(value)
    return {branch: sum(vals) / len(vals) for branch, vals in sums.items()}


def telemetry_line(step: int, records: dict[str, float]) -> str:
    """One console line: mean gate per branch over the layers, e.g. 'telemetry at step 100: gates cmp 0.41 ...'."""
    gates = layer_means(records, "gate_mean")
    if not gates:
        return f"telemetry at step {step}: no NSA layers"
    return f"telemetry at step {step}: mean gates " + " ".join(f"{b} {v:.3f}" for b, v in gates.items())
