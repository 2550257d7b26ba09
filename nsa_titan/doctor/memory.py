"""A per-device memory estimate for a recipe, from counts alone (nothing is allocated).

    states      = 16 B x P / shard         fp32 weights, fp32 grads, AdamW exp_avg and exp_avg_sq;
                                           FSDP shards all four over the shard degree, DDP does not
                                           (Muon keeps one buffer for its matrices, 4 B per parameter
                                           fewer; its step puts together whole the matrices a rank
                                           orthogonalizes, one turn at a time)
    gathered    = 2 x P_block x p_bytes    with shard > 1: the running block's all-gathered params
                                           plus the next one's prefetch (p_bytes 2 under bf16, else 4)
    activations = L_kept x A                A = (N x a + N x cp x r) x a_bytes, one block's saved tensors;
                + N x L_ckpt x i x a_bytes  N = local_batch_size x seq_len / cp tokens per micro-batch,
                + A                         a = elements saved per token per block, r = per token of the
                                           whole rows with context parallelism (cp > 1), a_bytes 2 under
                                           bf16 autocast else 4; a checkpointed block keeps only its
                                           input (i elements per token) and the one being recomputed
                                           holds a full block's worth (the last term)
    masks       = N x T x m x a_bytes      held once per forward: m elements per (local query, key of
                                           its row) pair, e.g. an explicit attention mask (T = seq_len)
    workspace   = W                        bytes one block's call holds beside what blocks save, at N
                                           tokens (the model part's hook says, e.g. a kernel's partials)
    logits      = N x V x 2 x a_bytes      logits and their gradient (on the CPU nsa_titan/loss.py
                + 12 x min(N x V, C)       upcasts one chunk of C values at a time: an fp32 chunk,
                                           its exponentials and slack; on a GPU its kernels hold
                                           a row in registers, and the last term is 0)
    buffers     = B                        the model's buffers as built (e.g. RoPE tables for every
                                           position up to max_seq_len); FSDP does not shard them
a, r, m, W and the blocks' count L come from the model part's activation_memory hook (the transformer's
formula is in components/models/hooks.py); V = vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from components.model_hooks import ActivationMemory
from nsa_titan.loss import CHUNK_ELEMENTS

GiB = 1024**3


@dataclass
class MemoryEstimate:
    params: int
    shard: int
    states: float
    gathered: float
    activations: float
    logits: float
    masks: float = 0.0
    workspace: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return (self.states + self.gathered + self.activations + self.masks + self.workspace + self.logits
                + self.buffers)

    def describe(self) -> str:
        masks = f" + masks {self.masks / GiB:.2f}" if self.masks else ""
        workspace = f" + workspace {self.workspace / GiB:.2f}" if self.workspace else ""
        buffers = f" + buffers {self.buffers / GiB:.2f}" if self.buffers >= 0.005 * GiB else ""
        return (f"~{self.total / GiB:.2f} GiB per device = states {self.states / GiB:.2f} (16 B x {self.params:,} "
                f"params / shard {self.shard}) + gathered {self.gathered / GiB:.2f} + activations "
                f"{self.activations / GiB:.2f}{masks}{workspace}{buffers} + logits {self.logits / GiB:.2f}")


def checkpointed_blocks(blocks: int, mode: str, every: int) -> int:
    if mode == "full":
        return blocks
    if mode == "selective":
        return math.ceil(blocks / every)  # blocks 0, every, 2 x every, ...
    return 0


def estimate_memory(*, activation: ActivationMemory, num_params: int, block_params: int, vocab_size: int, shard: int,
                    tokens: int, bf16: bool, ac_mode: str, ac_every: int, context_parallel: int = 1,
                    seq_len: int = 0, buffer_bytes: float = 0.0, chunked_loss: bool = True) -> MemoryEstimate:
    """Bytes per device for one training step of a model made of blocks (see the module docstring);
    tokens: those the rank holds per micro-batch, of rows of seq_len tokens."""
    a_bytes = 2 if bf16 else 4
    states = 16 * num_params / shard
    gathered = 2 * block_params * a_bytes if shard > 1 else 0.0
    per_block = tokens * (activation.per_block + context_parallel * activation.per_row_token) * a_bytes
    blocks = activation.blocks
    ckpt = checkpointed_blocks(blocks, ac_mode, ac_every)
    activations = (blocks - ckpt) * per_block + ckpt * tokens * activation.block_input * a_bytes
    if ckpt:
        activations += per_block
    logits = tokens * vocab_size * 2 * a_bytes + (12 * min(tokens * vocab_size, CHUNK_ELEMENTS) if chunked_loss else 0)
    masks = tokens * seq_len * activation.per_row_pair * a_bytes
    return MemoryEstimate(num_params, shard, states, gathered, activations, logits, masks, activation.workspace_bytes,
                          buffer_bytes)
