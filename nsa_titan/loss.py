"""Token cross-entropy over a large vocabulary, in fp32, without fp32 copies of all the logits: summed
with its gradient for training (token_cross_entropy_sum), per token for evaluation (token_cross_entropy).

F.cross_entropy(logits.float(), ...) holds an fp32 copy of the logits and saves an fp32 log-softmax
for the backward: at 65,536 tokens a step and a 50,257-token vocabulary that is 26 GB beside the
6.6 GB of bf16 logits. Here the backward keeps the logits (which exist anyway) and one fp32
log-sum-exp per row, and rebuilds the softmax from them. On a GPU one Triton kernel a pass reads each
row in fp32 registers (nsa_titan/loss_kernels.py); elsewhere the logits are read in row chunks of
about CHUNK_ELEMENTS values, each upcast to fp32 on its own. The result is the same function in
fp32 (only the order of the sum differs), targets equal to IGNORE_INDEX count nothing, as in
F.cross_entropy; a target outside the vocabulary raises on the CPU and gives NaN on a GPU.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from components.data import IGNORED_TARGET
from components.errors import UserError

IGNORE_INDEX = IGNORED_TARGET  # what the data gives for a position that counts nothing (-100, F.cross_entropy's)
CHUNK_ELEMENTS = 2**26  # fp32 values per chunk: 256 MiB, a few times over while a chunk is worked on
PADDING_LIMIT = 128  # columns past the vocabulary that still count as a padded row, not a wider tensor's slice


def _chunks(num_rows: int, vocab: int):
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, num_rows, rows):
        yield slice(start, min(start + rows, num_rows))


def _chunk_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, loss) per row of a chunk, in fp32; an ignored target's loss is 0."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    counted = targets != IGNORE_INDEX
    picked = x.gather(1, torch.where(counted, targets, 0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(counted, lse - picked, 0.0)


def _padded_rows(logits: torch.Tensor) -> bool:
    """Rows a few columns longer than the vocabulary (aligned for the matmuls), not a slice of wider rows."""
    return logits.stride(1) == 1 and logits.shape[1] <= logits.stride(0) < logits.shape[1] + PADDING_LIMIT


def _on_kernels(logits: torch.Tensor) -> bool:
    """Whether the Triton kernels do the work: on a GPU. (Triton is imported only then.)"""
    return logits.is_cuda


def _row_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, loss) per row of logits [N, V], in fp32: on a GPU one kernel, elsewhere in chunks."""
    if _on_kernels(logits):
        from nsa_titan.loss_kernels import row_losses

        return row_losses(logits, targets, IGNORE_INDEX)
    lse = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    losses = torch.empty_like(lse)
    for rows in _chunks(*logits.shape):
        lse[rows], losses[rows] = _chunk_losses(logits[rows], targets[rows])
    return lse, losses


class _TokenCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse, losses = _row_losses(logits, targets)
        ctx.save_for_backward(logits, targets, lse)
        return losses.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        # In the logits' own layout: a model may give rows padded for its matmuls (a view of wider rows),
        # and its backward then reads this gradient as it is.
        grad = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=logits.device) \
            if _padded_rows(logits) else torch.empty_like(logits)
        if _on_kernels(logits):
            from nsa_titan.loss_kernels import row_gradients

            row_gradients(grad, logits, targets, lse, grad_total, IGNORE_INDEX)
            return grad, None
        for rows in _chunks(*logits.shape):
            target = targets[rows]
            counted = target != IGNORE_INDEX
            # d(lse - x[target]) / dx = softmax(x) - onehot(target), per counted row.
            chunk = torch.exp(logits[rows].float() - lse[rows].unsqueeze(1))
            weight = counted.to(chunk.dtype)
            chunk.scatter_add_(1, torch.where(counted, target, 0).unsqueeze(1), -weight.unsqueeze(1))
            chunk *= (weight * grad_total).unsqueeze(1)
            grad[rows] = chunk
        return grad, None


def token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum over tokens of -log softmax(logits)[target], in fp32: logits [..., V] in any float dtype,
    targets [...] int64 (IGNORE_INDEX counts nothing); a 0-d fp32 tensor."""
    if logits.shape[:-1] != targets.shape:  # flattened, they would pair with the wrong targets and train on
        raise UserError(f"the model returned logits of shape {list(logits.shape)} for targets of shape "
                        f"{list(targets.shape)}. Fix: a model's forward returns logits [batch, tokens, vocab], one "
                        f"row per input token")
    return _TokenCrossEntropySum.apply(*_rows(logits, targets))


def _rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits as rows [N, V] with unit column stride (the kernels' layout; a view where it can be), targets [N]."""
    rows = logits.reshape(-1, logits.shape[-1])
    return (rows if rows.stride(-1) == 1 else rows.contiguous()), targets.reshape(-1).contiguous()


@torch.no_grad()
def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each token's -log softmax(logits)[target] in fp32, shaped like targets (0 where ignored); no
    gradient, computed as token_cross_entropy_sum."""
    return _row_losses(*_rows(logits, targets))[1].view(targets.shape)
