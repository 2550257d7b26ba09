"""The output layer (hidden state -> logits over the vocabulary), with rows cuBLAS can run fast.

A vocabulary whose size is not a multiple of 8 (GPT-2's 50,257) gives [tokens, vocab] logits rows that
break the 16-byte alignment of cuBLAS's fast kernels: on an H200 the layer's three matmuls (logits,
input gradient, weight gradient) fell back to generic sm75 kernels and took 118 ms of a 322 ms step of
dense_125m at 65,536 tokens (bench.train_throughput --profile). On a GPU the logits are therefore computed
into rows padded to a multiple of ROW_MULTIPLE and returned as a view of their first vocab_size columns;
the backward works in that layout too, padding the incoming gradient only where it lacks it (the
training loss gives it). The function and the weight ([vocab, dim], as checkpoints and exports hold it)
are unchanged; on the CPU, where alignment costs nothing, and for fewer than MIN_ROWS tokens (a decoding
step), it is a plain linear layer. The logits it returns with padded rows are a view: change them out of
place (logits * c, not logits.mul_(c)) where autograd records it, as for any custom function's view.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

ROW_MULTIPLE = 64  # elements: 128 bytes in bf16, a whole number of the matmul's tiles' columns
MIN_ROWS = 1024  # tokens from which the padded rows are used


def aligned_rows(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor's rows suit cuBLAS's fast kernels: unit column stride, 16-byte row stride and start."""
    size = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def _padded_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t [N, V] copied into rows of `width` columns (zeros past V); returned as the [N, V] view."""
    padded = t.new_zeros(t.shape[0], width)
    padded[:, :t.shape[1]] = t
    return padded[:, :t.shape[1]]


def padded_width(vocab_size: int) -> int:
    return -(-vocab_size // ROW_MULTIPLE) * ROW_MULTIPLE


def _input_gradient(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad [N, V] @ weight [V, D], summing over V in two parts: the first V rounded down to a multiple of 8
    and the rest. An odd V along the gradient's rows sets cuBLAS back to its generic kernels even where the
    rows are padded (39 ms of a 470 ms nsa_125m step on an H200); the rest (at most 7 terms) is a small
    rank-k update."""
    whole = grad.shape[1] - grad.shape[1] % 8
    if whole == grad.shape[1]:
        return grad @ weight
    # The rest first, so the large product's fp32 sum is rounded once, with it.
    return torch.addmm(grad[:, whole:] @ weight[whole:], grad[:, :whole], weight[:whole])


class _PaddedRowsLinear(torch.autograd.Function):
    """x [..., D] @ weight[V, D].T as a view [..., V] of rows padded_width(V) long."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        vocab, dim = weight.shape
        padded_weight = F.pad(weight, (0, 0, 0, padded_width(vocab) - vocab))
        logits = x.reshape(-1, dim) @ padded_weight.t()
        ctx.save_for_backward(x, weight)
        return logits[:, :vocab].unflatten(0, x.shape[:-1])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        vocab, dim = weight.shape
        grad = grad.reshape(-1, vocab)
        if not aligned_rows(grad):
            grad = _padded_rows(grad, padded_width(vocab))
        grad_x = _input_gradient(grad, weight.to(grad.dtype)).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ x.reshape(-1, dim).to(grad.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def padded_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias), computed in rows padded to a multiple of ROW_MULTIPLE columns."""
    return _PaddedRowsLinear.apply(x, weight)


class OutputHead(nn.Linear):
    """nn.Linear(dim, vocab_size, bias=False) whose logits have padded rows on a GPU (see the module's doc)."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A few rows (a decoding step) gain nothing from alignment and would pay for the padded weight's copy.
        if x.is_cuda and self.weight.shape[0] % ROW_MULTIPLE and x.dim() > 1 and x.numel() >= MIN_ROWS * x.shape[-1]:
            return padded_rows_linear(x, self.weight)
        return F.linear(x, self.weight)
