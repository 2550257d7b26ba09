"""Telemetry records: flat float keys from collect_nsa_telemetry."""

from __future__ import annotations

import json

import pytest
import torch

from components.models import build_transformer, collect_nsa_telemetry
from nsa_titan.observe.metrics_log import MetricsLog
from nsa_titan.observe.telemetry_log import layer_means, telemetry_line, telemetry_records
from tests.test_models_helpers import VOCAB, tiny_args


def test_keys_and_values():
    stats = {"nsa/layer0/sel/gate_mean": torch.tensor(0.25), "nsa/layer1/sel/gate_mean": torch.tensor(0.75),
             "nsa/layer0/sel_distance/2-3": torch.tensor(0.5, dtype=torch.float64)}
    records = telemetry_records(stats)
    assert records == {"telemetry/layer0/sel/gate_mean": 0.25, "telemetry/layer1/sel/gate_mean": 0.75,
                       "telemetry/layer0/sel_distance/2-3": 0.5}
    assert all(type(v) is float for v in records.values())
    assert telemetry_records({}) == {}
    assert layer_means(records, "gate_mean") == {"sel": 0.5}
    assert telemetry_line(4, records) == "telemetry at step 4: mean gates sel 0.500"


def test_real_telemetry(tmp_path):
    model = build_transformer(tiny_args(n_layers=2), VOCAB)
    stats = collect_nsa_telemetry(model, torch.randint(0, VOCAB, (2, 40)))
    records = telemetry_records(stats)
    assert len(records) == len(stats)
    for key, value in stats.items():
        assert records["telemetry/" + key[len("nsa/"):]] == pytest.approx(value.item(), abs=0)
    for branch in ("cmp", "sel", "win"):
        expected = (stats[f"nsa/layer0/{branch}/gate_mean"] + stats[f"nsa/layer1/{branch}/gate_mean"]).item() / 2
        assert layer_means(records, "gate_mean")[branch] == pytest.approx(expected, rel=1e-6)
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    log.write({"step": 3, **records})
    log.close()
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as fh:
        assert json.loads(fh.read()) == {"step": 3, **records}
