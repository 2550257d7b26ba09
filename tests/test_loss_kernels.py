"""The loss's Triton kernels (nsa_titan/loss_kernels.py), what a GPU runs: the same loss, per-token losses
and gradient as F.cross_entropy in fp32, over rows several blocks long, padded rows, ignored targets and
masked (-inf) logits. Without a GPU they run under Triton's interpreter (tests/conftest.py) in fp32 and
fp16; a subprocess compiles them for sm_90 and sm_80 in bf16, as a GPU would."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nsa_titan import loss as loss_module
from nsa_titan import loss_kernels
from nsa_titan.loss import IGNORE_INDEX, token_cross_entropy, token_cross_entropy_sum
from tests.launch import REPO_ROOT, env

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernels(monkeypatch):
    """The loss on its kernels (on the CPU: the interpreter), with blocks small enough that a row takes several."""
    monkeypatch.setattr(loss_module, "_on_kernels", lambda logits: True)
    monkeypatch.setattr(loss_kernels, "BLOCK", 32)


def _case(dtype, rows=2 * 9, vocab=101, seed=0, padded_to=None):
    g = torch.Generator().manual_seed(seed)
    width = padded_to or vocab
    buffer = (torch.randn(2, rows // 2, width, generator=g) * 4).to(dtype)
    logits = buffer[..., :vocab].to(DEVICE).requires_grad_() if padded_to is None else \
        buffer.to(DEVICE)[..., :vocab].detach().requires_grad_()
    targets = torch.randint(0, vocab, (2, rows // 2), generator=g)
    targets[0, ::4] = IGNORE_INDEX
    return logits, targets.to(DEVICE)


def _reference(logits, targets, grad_out):
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return ref, torch.autograd.grad(ref, logits, grad_out)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("padded_to", [None, 128, 101 + loss_module.PADDING_LIMIT + 99],
                         ids=["rows", "padded-rows", "slice-of-wider-rows"])
def test_loss_and_gradient_match_fp32_cross_entropy(kernels, dtype, padded_to):
    """Rows padded a few columns (an output layer's aligned rows) get their gradient in that layout; a slice of
    wider rows (some other tensor's columns) a dense gradient of its own."""
    logits, targets = _case(dtype, padded_to=padded_to)
    assert logits.stride(-2) == (padded_to or 101)
    grad_out = torch.tensor(0.37, device=DEVICE)
    mine = token_cross_entropy_sum(logits, targets)
    (mine_grad,) = torch.autograd.grad(mine, logits, grad_out)
    ref, ref_grad = _reference(logits, targets, grad_out)
    assert mine.dtype == torch.float32 and mine.shape == ()
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-4)
    padded = padded_to is not None and padded_to < 101 + loss_module.PADDING_LIMIT
    assert mine_grad.dtype == dtype
    assert mine_grad.stride() == (logits.stride() if padded else (9 * 101, 101, 1))
    # The same fp32 gradient, rounded to the logits' dtype once.
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-10, atol=1e-6)
    torch.testing.assert_close(mine_grad.float(), ref_grad.float(), **tol)
    assert (mine_grad[0, ::4] == 0).all()  # ignored targets give no gradient


def test_per_token_losses_match_fp32_cross_entropy(kernels):
    logits, targets = _case(torch.float32, padded_to=128)
    mine = token_cross_entropy(logits, targets)
    ref = F.cross_entropy(logits.detach().float().flatten(0, 1), targets.flatten(), reduction="none")
    assert mine.shape == targets.shape and mine.dtype == torch.float32
    torch.testing.assert_close(mine.flatten(), ref, rtol=1e-6, atol=1e-5)


def test_masked_logits_and_a_whole_masked_block_count_nothing(kernels):
    """-inf logits (a vocabulary masked off) take no probability, as in F.cross_entropy, even where some of a
    program's lanes see nothing but -inf: no NaN from -inf - -inf."""
    logits, targets = _case(torch.float32, vocab=101)
    with torch.no_grad():
        logits[:, :, 30:] = float("-inf")  # lanes 30 and 31 of a 32-column block see nothing else
        targets.clamp_(max=29)
    grad_out = torch.tensor(1.0, device=DEVICE)
    mine = token_cross_entropy_sum(logits, targets)
    (mine_grad,) = torch.autograd.grad(mine, logits, grad_out)
    ref, ref_grad = _reference(logits, targets, grad_out)
    assert torch.isfinite(mine) and torch.isfinite(mine_grad).all()
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(mine_grad, ref_grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("column", [0, 100], ids=["first-block", "last-block"])
def test_a_nan_logit_makes_its_rows_loss_nan_as_in_f_cross_entropy(kernels, column):
    """Where a NaN is a lane's first value too (a maximum that skipped NaNs would drop it)."""
    logits, targets = _case(torch.float32)
    with torch.no_grad():
        logits[1, 2, column] = float("nan")
    per_token = token_cross_entropy(logits, targets)
    assert per_token[1, 2].isnan() and per_token[1, :2].isfinite().all()
    assert token_cross_entropy_sum(logits, targets).isnan()


def test_a_target_outside_the_vocabulary_gives_nan_not_a_neighbours_logit(kernels):
    logits, targets = _case(torch.float32, padded_to=128)
    targets = targets.clone()
    targets[1, 0], targets[1, 1], targets[1, 2] = 101, -1, 127  # past the vocabulary, negative, in the padding
    per_token = token_cross_entropy(logits, targets)
    assert per_token[1, :3].isnan().all() and per_token[1, 3:].isfinite().all()
    total = token_cross_entropy_sum(logits, targets)
    (grad,) = torch.autograd.grad(total, logits)
    assert total.isnan() and grad[1, :3].isnan().all() and grad[1, 3:].isfinite().all()


def test_no_rows_is_zero(kernels):
    logits = torch.zeros(0, 7, requires_grad=True, device=DEVICE)
    total = token_cross_entropy_sum(logits, torch.zeros(0, dtype=torch.long, device=DEVICE))
    total.backward()
    assert total.item() == 0.0 and logits.grad.shape == (0, 7)


def _spy_on_kernels(monkeypatch) -> list[str]:
    """The names of the loss kernels' launchers as they are called."""
    calls = []
    for name in ("row_losses", "row_gradients"):
        launcher = getattr(loss_kernels, name)
        monkeypatch.setattr(loss_kernels, name,
                            lambda *args, _name=name, _launcher=launcher: calls.append(_name) or _launcher(*args))
    return calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_loss_runs_its_kernels_in_bf16_at_gpt2s_vocabulary(monkeypatch):
    """What a GPU training step runs (no forcing, the shipped block size): GPT-2's 50,257 columns, bf16."""
    calls = _spy_on_kernels(monkeypatch)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 50257, generator=g) * 4).to(torch.bfloat16).cuda().requires_grad_()
    targets = torch.randint(0, 50257, (64,), generator=g).cuda()
    targets[::5] = IGNORE_INDEX
    grad_out = torch.tensor(0.5, device="cuda")
    mine = token_cross_entropy_sum(logits, targets)
    (mine_grad,) = torch.autograd.grad(mine, logits, grad_out)
    ref = F.cross_entropy(logits.float(), targets, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, logits, grad_out)
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(mine_grad.float(), ref_grad.float(), rtol=2**-7, atol=1e-7)
    assert calls == ["row_losses", "row_gradients"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_rows_past_two_to_the_31_elements_are_their_own(monkeypatch):
    """A training step's logits (65,536 rows of GPT-2's vocabulary in padded rows of 50,304, bf16) span more than
    2**31 elements: the last rows' losses and gradients are read and written where those rows stand."""
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip(f"needs 24 GiB of free GPU memory, {free / 2**30:.1f} free")
    calls = _spy_on_kernels(monkeypatch)
    rows, vocab = 65536, 50257
    torch.manual_seed(0)
    logits = torch.randn(rows, 50304, device="cuda", dtype=torch.bfloat16)[:, :vocab].mul_(4).detach()
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    tail = slice(rows - 8, rows)
    losses = token_cross_entropy(logits.detach(), targets)[tail]
    (grad,) = torch.autograd.grad(token_cross_entropy_sum(logits, targets), logits)
    assert logits.storage_offset() + (rows - 1) * logits.stride(0) >= 2**31
    last = logits.detach()[tail].float().requires_grad_()
    ref = F.cross_entropy(last, targets[tail], reduction="none")
    (ref_grad,) = torch.autograd.grad(ref.sum(), last)
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad[tail].float(), ref_grad, rtol=2**-7, atol=1e-7)
    assert calls == ["row_losses", "row_losses", "row_gradients"]


_COMPILE = """
import json, sys, torch
from components.nsa.triton.offline_compile import compile_only, target_for
from nsa_titan import loss_kernels
logits, targets = torch.empty(8, 50304, dtype=torch.bfloat16)[:, :50257], torch.zeros(8, dtype=torch.long)
lse, scale = torch.empty(8), torch.ones(())
found = {}
for arch in (90, 80):
    with compile_only(target_for(arch)) as kernels:
        loss_kernels.row_losses(logits, targets, -100)
        loss_kernels.row_gradients(torch.empty_like(logits), logits, targets, lse, scale, -100)
    found[arch] = [[k.name, k.shared_bytes, k.shared_limit_bytes, k.stack_bytes] for k in kernels]
print(json.dumps(found))
"""


def test_the_kernels_compile_for_hopper_and_ampere_in_bf16():
    child_env = {k: v for k, v in env().items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=REPO_ROOT, env=child_env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for arch in ("90", "80"):
        assert [name for name, *_ in found[arch]] == ["_row_losses_kernel", "_row_gradients_kernel"]
        for name, shared, limit, stack in found[arch]:
            assert shared <= limit, (arch, name)
            assert stack in (0, None), (arch, name, stack)  # no register spills
