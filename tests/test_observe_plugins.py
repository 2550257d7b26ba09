"""The fault-injection plugins: NaN losses at chosen steps, a data source that hangs after N batches."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import pytest
import torch

from nsa_titan import registry
from nsa_titan.observe.watchdog import HANG_EXIT_CODE
from tests.conftest import REPO_ROOT
from tests.test_models_helpers import VOCAB, tiny_args


@pytest.fixture
def nan_plugin():
    """The plugin module, imported for this test only (its registration is removed afterwards)."""
    module = importlib.import_module("tests.plugins.nan_at_step")
    yield module
    registry._PARTS["model"].pop("nan_at_step", None)
    sys.modules.pop("tests.plugins.nan_at_step", None)


def _nan_model(module, **settings):
    base = dataclasses.asdict(tiny_args(n_layers=1))
    base["nsa"] = tiny_args().nsa
    args = module.NanAtStepArgs(**base, **settings)
    return registry.get("model", "nan_at_step").build(args, VOCAB)


def test_nan_steps_with_accumulation(nan_plugin):
    model = _nan_model(nan_plugin, nan_at_step=2, nan_steps=2, micro_batches=2)
    tokens = torch.randint(0, VOCAB, (1, 12))
    finite = []
    for forward in range(8):  # steps 1, 1, 2, 2, 3, 3, 4, 4
        model.train()
        finite.append(bool(torch.isfinite(model(tokens)).all()))
        if forward == 2:
            model.eval()  # evaluation forwards are not counted and stay finite
            assert torch.isfinite(model(tokens)).all()
    assert finite == [True, True, False, False, False, False, True, True]


def test_nan_forever(nan_plugin):
    model = _nan_model(nan_plugin, nan_at_step=3, nan_steps=0).train()
    tokens = torch.randint(0, VOCAB, (1, 12))
    assert [bool(torch.isfinite(model(tokens)).all()) for _ in range(6)] == [True, True, False, False, False, False]


HANG_CHILD = """
import sys
import tests.plugins.hang as hang
from components.data import build_dataloader
from components.data.tokenizers import ByteTokenizer
from nsa_titan.observe.watchdog import Watchdog

dump = sys.argv[1]
source = hang.HangAfterSource(hang.HangAfterArgs(after_batches=3, batch_size=2, seq_len=16))
loader = build_dataloader(source, ByteTokenizer(), seq_len=16, batch_size=2, logical_shards=4)
watchdog = Watchdog(6.0, 60.0, dump)  # far above a batch's time, even on a loaded machine
for step, batch in enumerate(loader, start=1):
    assert batch["input"].shape == (2, 16)
    print(f"batch {step}", flush=True)
    watchdog.beat(step)
"""


@pytest.mark.slow
def test_hang_after_batches_is_caught_by_the_watchdog(tmp_path):
    dump = tmp_path / "stacks.txt"
    proc = subprocess.run([sys.executable, "-c", HANG_CHILD, str(dump)], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert proc.stdout.split() == ["batch", "1", "batch", "2", "batch", "3"]
    assert "blocking the data source after 3 batch(es)" in proc.stderr
    assert "_blocked_forever" in dump.read_text() and "after step 3" in proc.stderr
