"""A per-device memory estimate for a recipe, from counts alone (nothing is allocated).

    states      = 16 B x P / shard         fp32 weights, fp32 grads, AdamW exp_avg and exp_avg_sq;
                                           FSDP shards all four over the shard degree, DDP does not
    gathered    = 2 x P_block x p_bytes    with shard > 1: the running block's all-gathered params
                                           plus the next one's prefetch (p_bytes 2 under bf16, else 4)
    activations = N x L_kept x a x a_bytes  N = local_batch_size x seq_len tokens per micro-batch,
                + N x a x a_bytes           a = elements saved per token per block (below), a_bytes 2
                                           under bf16 autocast else 4; a checkpointed block keeps only
                                           its input (dim per token) and the one being recomputed
                                           holds a full block's worth (the second term)
    logits      = N x V x (a_bytes + 8)    logits, their fp32 copy for the loss and its gradient
Elements saved per token per block, a:
    4 d + 4 h                              two RMSNorms (input, output) and SwiGLU (w1, w3, silu, product)
  + dense attention: 3 d + 2 kv + H        q, k, v, attention output and its log-sum-exp
  + NSA: 6 d + (n_kv + 2) kv + 2 (l/d) kv + d/2 + 3 H
                                           q, the fused K/V projection, rotated keys, compression MLP
                                           inputs, gate MLP, three branch outputs in fp32, gated output
d = dim, h = SwiGLU hidden, kv = n_kv_heads x head_dim, H = n_heads, V = vocab. Attention scores
are not counted: the reference computes them in bounded chunks and the kernels keep none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1024**3


@dataclass
class MemoryEstimate:
    params: int
    shard: int
    states: float
    gathered: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations + self.logits

    def describe(self) -> str:
        return (f"~{self.total / GiB:.2f} GiB per device = states {self.states / GiB:.2f} (16 B x {self.params:,} "
                f"params / shard {self.shard}) + gathered {self.gathered / GiB:.2f} + activations "
                f"{self.activations / GiB:.2f} + logits {self.logits / GiB:.2f}")


def activation_elements_per_token(args) -> float:
    """a: the elements one block saves for backward per token (formula in the module docstring)."""
    d, H = args.dim, args.n_heads
    kv = args.n_kv_heads * args.head_dim
    common = 4 * d + 4 * args.mlp_hidden_dim()
    if getattr(args, "attention", "dense") != "nsa":
        return common + 3 * d + 2 * kv + H
    nsa = args.nsa
    n_kv = 6 if nsa.kv_per_branch else 2
    return common + 6 * d + (n_kv + 2) * kv + 2 * (nsa.block_size / nsa.block_stride) * kv + d / 2 + 3 * H


def checkpointed_blocks(n_layers: int, mode: str, every: int) -> int:
    if mode == "full":
        return n_layers
    if mode == "selective":
        return math.ceil(n_layers / every)  # blocks 0, every, 2 x every, ...
    return 0


def estimate_memory(*, args, num_params: int, block_params: int, vocab_size: int, shard: int, tokens: int,
                    bf16: bool, ac_mode: str, ac_every: int) -> MemoryEstimate:
    """Bytes per device for one training step of a transformer-like model (see the module docstring)."""
    a_bytes = 2 if bf16 else 4
    states = 16 * num_params / shard
    gathered = 2 * block_params * a_bytes if shard > 1 else 0.0
    per_block = tokens * activation_elements_per_token(args) * a_bytes
    n_layers = args.n_layers
    ckpt = checkpointed_blocks(n_layers, ac_mode, ac_every)
    activations = (n_layers - ckpt) * per_block + ckpt * tokens * args.dim * a_bytes
    if ckpt:
        activations += per_block
    logits = tokens * vocab_size * (a_bytes + 8)
    return MemoryEstimate(num_params, shard, states, gathered, activations, logits)
