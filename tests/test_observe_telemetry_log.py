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


def test_resumed_metrics_set_aside_later_steps_and_a_cut_line(tmp_path, monkeypatch):
    """Records past the resume step and a last line cut short by a crash move beside the file; a second
    set-aside within the same second gets a file of its own; appending after it gives whole records."""
    from nsa_titan.observe import metrics_log

    monkeypatch.setattr(metrics_log.time, "strftime", lambda fmt: "20260101-000000")
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "loss": 1.5}\n{"step": 4, "lo')
    log = MetricsLog(str(path), start_step=2)
    log.write({"step": 3, "loss": 1.25})
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 1.25}]
    first = tmp_path / "metrics.after-step-2-20260101-000000.jsonl"
    assert log.set_aside == str(first) and first.read_text() == '{"step": 3, "loss": 1.5}\n{"step": 4, "lo\n'
    again = MetricsLog(str(path), start_step=2)  # the same crash loop, within the second
    again.close()
    assert again.set_aside == str(tmp_path / "metrics.after-step-2-20260101-000000-2.jsonl")
    assert first.read_text().startswith('{"step": 3, "loss": 1.5}')  # the first set-aside kept
    assert MetricsLog(str(path), start_step=3).set_aside is None  # nothing past step 3, no cut line
