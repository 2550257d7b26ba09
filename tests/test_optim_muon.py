"""optimizer.name = "muon": which parameters Muon updates, its update against torch's own Muon and AdamW, and
a state that resumes exactly (the sharded path runs in tests/test_distributed.py)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from components.optim.muon import MuonArgs, build_muon, muon_params, orthogonalized
from components.optim.sharded_orthogonalize import largest_first
from nsa_titan import assemble
from nsa_titan.config import resolve
from tests.launch import DEBUG

pytestmark = pytest.mark.usefixtures("one_thread")
HYPER = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model(*flags):
    recipe = resolve([DEBUG, "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                      *flags]).recipe
    torch.manual_seed(0)
    model = assemble.build_model_on_meta(recipe, 258)
    assemble.materialize(model, torch.device("cpu"), 0, distributed=False,
                         build_reference=lambda: assemble.build_model_on_meta(recipe, 258))
    return model


def _names(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tied", [False, True])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tied):
    model = _model(f"--model.tie_embeddings={str(tied).lower()}")
    muon = _names(model, muon_params(model))
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert muon and muon <= linear and all(".layers." in f".{n}" for n in muon)
    # Every block's linear layers are Muon's: attention projections, NSA's gate and compression, the MLP.
    assert {n for n in linear if n.startswith("layers.")} == muon
    rest = {n for n, _ in model.named_parameters()} - muon
    assert {n for n in rest if n.startswith(("tok_embeddings", "output"))} == (
        {"tok_embeddings.weight"} if tied else {"tok_embeddings.weight", "output.weight"})
    optimizer = build_muon(model, **HYPER, args=MuonArgs())
    groups = {(g["muon"], g["weight_decay"]): _names(model, g["params"]) for g in optimizer.param_groups}
    assert groups[(True, 0.1)] == muon
    assert "tok_embeddings.weight" in groups[(False, 0.0)]  # tables are not decayed
    assert ("output.weight" in groups.get((False, 0.1), set())) != tied  # an untied head is decayed, by AdamW


def test_a_hidden_layer_as_wide_as_the_vocabulary_is_still_muons():
    """The head is the layer the model names, not any layer sharing a size with the vocabulary: an MLP of
    256 hidden units over a 256-token vocabulary keeps Muon."""
    from components.models.args import TransformerArgs
    from components.models.transformer import Transformer

    args = TransformerArgs(dim=96, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=128)
    assert args.mlp_hidden_dim() == 256
    model = Transformer(args, 256)
    muon = _names(model, muon_params(model))
    assert {"layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight"} <= muon
    assert "output.weight" not in muon

    class Plain(torch.nn.Module):  # no get_output_embeddings: the head is found by its exact shape
        def __init__(self):
            super().__init__()
            self.embed, self.hidden = torch.nn.Embedding(256, 96), torch.nn.Linear(96, 256)
            self.back, self.head = torch.nn.Linear(256, 96), torch.nn.Linear(96, 256)

    plain = Plain()
    assert _names(plain, muon_params(plain)) == set()  # (256, 96) and (96, 256) both look like the table
    plain.hidden, plain.back = torch.nn.Linear(96, 200), torch.nn.Linear(200, 96)
    assert _names(plain, muon_params(plain)) == {"hidden.weight", "back.weight"}


def _random_grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.01


def test_steps_equal_torchs_muon_and_adamw():
    """Three steps on random gradients: the Muon matrices exactly as torch.optim.Muon (torch's own
    implementation, for single tensors) moves them, the rest exactly as torch.optim.AdamW."""
    model = _model()
    reference = copy.deepcopy(model)
    ours = build_muon(model, **HYPER, args=MuonArgs())
    matrices = muon_params(reference)
    theirs_muon = torch.optim.Muon(matrices, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], momentum=0.95,
                                   nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    decayed = [g for g in ours.param_groups if not g["muon"]]
    by_name = dict(reference.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    theirs_adamw = torch.optim.AdamW([{"params": [by_name[names[id(p)]] for p in g["params"]],
                                       "weight_decay": g["weight_decay"]} for g in decayed],
                                     lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], foreach=True)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(3):
        _random_grads(model, step)
        _random_grads(reference, step)
        ours.step()
        theirs_muon.step()
        theirs_adamw.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p, start[name]), name
        torch.testing.assert_close(p, by_name[name], rtol=0, atol=0, msg=name)


def test_orthogonalized_has_singular_values_near_one():
    gen = torch.Generator().manual_seed(0)
    for shape in ((64, 16), (16, 64), (48, 48)):
        s = torch.linalg.svdvals(orthogonalized(torch.randn(*shape, generator=gen), 5).float())
        assert s.min() > 0.5 and s.max() < 1.3, (shape, s.min(), s.max())


def test_sharded_turns_take_the_costliest_matrices_first():
    # cost rows x cols x min(rows, cols): (2048, 768) and (768, 2048) tie, then (768, 768), then the (256, 768)s
    shapes = [torch.Size(s) for s in [(256, 768), (2048, 768), (768, 768), (768, 2048), (256, 768)]]
    assert largest_first([10, 11, 12, 13, 14], shapes) == [11, 13, 12, 10, 14]  # ties keep parameter order


def test_a_saved_state_resumes_exactly():
    """Through the state dict checkpoints save (DCP's get/set_optimizer_state_dict): five steps equal three,
    a save, a fresh model and optimizer loaded from it, and two more, to the bit."""
    model = _model()
    optimizer = build_muon(model, **HYPER, args=MuonArgs())
    for step in range(3):
        _random_grads(model, step)
        optimizer.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    assert any("momentum_buffer" in s for s in saved["state"].values())
    assert any("exp_avg" in s for s in saved["state"].values())
    for step in (3, 4):
        _random_grads(model, step)
        optimizer.step()

    resumed = _model()
    resumed.load_state_dict(saved_model)
    again = build_muon(resumed, **HYPER, args=MuonArgs())
    set_optimizer_state_dict(resumed, again, saved)
    for step in (3, 4):
        _random_grads(resumed, step)
        again.step()
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_the_lr_schedule_drives_both_groups():
    model = _model()
    optimizer = build_muon(model, **HYPER, args=MuonArgs())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 if step == 0 else 0.25)
    assert {g["lr"] for g in optimizer.param_groups} == {HYPER["lr"] * 0.5}
    _random_grads(model, 0)
    optimizer.step()
    schedule.step()
    assert {g["lr"] for g in optimizer.param_groups} == {HYPER["lr"] * 0.25}
    # torch's AdamW steps this optimizer's own AdamW groups (the dicts the schedule sets), not copies
    assert all(any(g is mine for mine in optimizer.param_groups) for g in optimizer._adamw.param_groups)


def test_a_copy_steps_like_the_original():
    """copy.deepcopy keeps an optimizer's groups and state only: the copy rebuilds its AdamW part."""
    model = _model()
    optimizer = build_muon(model, **HYPER, args=MuonArgs())
    _random_grads(model, 0)
    optimizer.step()
    twin_model = copy.deepcopy(model)
    twin = build_muon(twin_model, **HYPER, args=MuonArgs())
    twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # a live state dict shares its tensors
    copied = copy.deepcopy(twin)  # a copy of the optimizer alone (its params are copies too)
    assert not hasattr(copied, "_adamw") or copied._adamw is None
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    copied_params = [p for g in copied.param_groups for p in g["params"]]
    assert len(copied_params) == len(twin_params) == len(list(twin_model.parameters()))
    assert [g["muon"] for g in copied.param_groups] == [g["muon"] for g in twin.param_groups]
    assert {g["muon"] for g in copied.param_groups} == {True, False}  # both parts step below
    for p, q in zip(twin_params, copied_params, strict=True):
        assert p is not q and torch.equal(p, q)
    for opt, m in ((optimizer, model), (twin, twin_model)):
        _random_grads(m, 1)
        opt.step()
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(twin_params, copied_params, strict=True):
        q.grad = p.grad.clone()  # the gradients the twin's second step took
    copied.step()  # the AdamW part is built again, from the copied state (step counts and moments)
    for p, q in zip(twin_params, copied_params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("layout,nproc", [("1d", 3), ("2d", 4)])
def test_sharded_matrices_are_dealt_out_and_come_back_exact(layout, nproc):
    """Row-sharded matrices (uneven, some with fewer rows than ranks) orthogonalized by one rank each give
    every rank its rows of the whole matrix's result, to the bit; each rank ran only its share."""
    import os
    import subprocess
    import sys

    from tests.launch import REPO_ROOT, env

    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               "--standalone",
               os.path.join(REPO_ROOT, "tests", "sharded_orthogonalize_worker.py"), layout]
    proc = subprocess.run(command, capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [int(n) for n in re.findall(r"rank \d+: ok (\d+)", proc.stdout)]  # ranks' lines may interleave
    shard_group = nproc if layout == "1d" else nproc // 2
    assert len(runs) == nproc and sum(runs) == 7 * (nproc // shard_group)  # every matrix once per shard group
